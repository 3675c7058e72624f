"""``vmemkv simulate --find-max-rate --slo ttft_p90=2000,tpot_p99=200``: capacity search.

With ``--trace`` the search is over ``--rate-scale`` (starting at the value given) and reports
the request rate it gives (requests / replayed span); on a generated workload it is over
``--arrival-rate`` (Poisson, requests/s; starting at the value given, or 4 req/s). One progress
bar step per simulation; the table lists every probe.
"""
from __future__ import annotations

import argparse
from typing import Callable

from .capacity import CapacityResult, Probe, find_max_load, parse_slo, report_key
from .cli_checks import Given, GivenOnce
from .cli_table import to_json
from .cliargs import bounded, write_stdout
from .progress import Progress

DEFAULT_START_RATE = 4.0   # requests/s: a generated workload's first probe without --arrival-rate


def add_flags(group) -> None:
    group.add_argument("--find-max-rate", action="store_true",
                       help="search the highest load meeting --slo (trace: --rate-scale; "
                            "generated: --arrival-rate)")
    group.add_argument("--slo", type=_slo, default=None, metavar="TARGETS",
                       action=GivenOnce,
                       help="latency targets in ms, e.g. ttft_p90=2000,tpot_p99=200 (default: none; "
                            "--find-max-rate needs it)")
    group.add_argument("--search-tolerance", type=bounded(float, 0, 1, low_open=True, high_open=True),
                       default=0.02, action=Given,
                       help="stop when the bracket is this close (relative), in (0, 1)")
    group.add_argument("--max-probes", type=bounded(int, 2), default=24,
                       action=Given, help="at most this many simulations")


def _slo(text: str):
    from .errors import ConfigError
    try:
        return parse_slo(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args, config, entries_for: Callable[[argparse.Namespace], list]) -> int:
    """The search; ``entries_for(args)`` builds the workload the flags describe."""
    if args.slo is None:
        from .errors import ConfigError
        raise ConfigError("--find-max-rate needs --slo, e.g. --slo ttft_p90=2000,tpot_p99=200")
    knob = "rate_scale" if args.trace else "arrival_rate"
    start = getattr(args, knob) or DEFAULT_START_RATE

    def make_entries(load: float):
        return entries_for(argparse.Namespace(**{**vars(args), knob: load}))

    enabled, probes, result = False if args.no_progress else None, [], None

    def on_probe(probe: Probe) -> None:
        probes.append(probe)
        bar.update(1)

    with Progress(args.max_probes, f"find-max-rate {args.policy}", enabled=enabled) as bar:
        try:
            result = find_max_load(make_entries, config, args.slo, start=start,
                                   rel_tol=args.search_tolerance, max_probes=args.max_probes,
                                   on_probe=on_probe)
        except KeyboardInterrupt:       # Ctrl-C: the probes that finished, then the note
            pass
    out = _summary(result or CapacityResult(None, args.slo, probes), knob, result is None)
    write_stdout(to_json(out) + "\n" if args.json else format_search(out))
    if result is None:
        raise KeyboardInterrupt(f"{len(probes)} of at most {args.max_probes} probes had finished, "
                                f"listed above; the search has no answer")
    return 0 if result.max_load is not None else 1


def _summary(result: CapacityResult, knob: str, interrupted: bool = False) -> dict:
    best = result.best
    return {"searched": knob, "slo_ms": result.slo, "max_load": result.max_load,
            "bounded": result.bounded, **({"interrupted": True} if interrupted else {}),
            "max_request_rate": best.figures["request_throughput"] if best else None,
            "probes": [_probe_row(p, result.slo) for p in result.probes]}


def _probe_row(p: Probe, slo: dict) -> dict:
    row = {"load": p.load, "meets": p.meets,
           "request_throughput": p.figures["request_throughput"],
           "output_throughput": p.figures["output_throughput"]}
    row.update({report_key(t): p.figures[report_key(t)] for t in slo})
    return row


def format_search(out: dict) -> str:
    """Every probe in load order, then the answer."""
    keys = [report_key(t) for t in out["slo_ms"]]
    lines = [f"vmemkv simulate --find-max-rate over {out['searched']}, SLO "
             + ", ".join(f"{t} <= {ms:g} ms" for t, ms in out["slo_ms"].items()),
             f"  {out['searched']:>12} {'req/s':>9} {'out tok/s':>10} "
             + " ".join(f"{k:>14}" for k in keys) + "  meets"]
    for row in sorted(out["probes"], key=lambda r: r["load"]):
        lines.append(f"  {row['load']:>12.4g} {row['request_throughput']:>9.3f} "
                     f"{row['output_throughput']:>10,.0f} "
                     + " ".join(f"{row[k]:>14,.1f}" for k in keys)
                     + f"  {'yes' if row['meets'] else 'no'}")
    if out.get("interrupted"):
        lines.append(f"  interrupted after {len(out['probes'])} probes: no answer")
    elif out["max_load"] is None:
        lines.append("  no probed load meets the SLO")
    else:
        lines.append(f"  max {out['searched']} meeting the SLO: {out['max_load']:.4g} "
                     f"({out['max_request_rate']:.3f} requests/s completed)"
                     + ("" if out["bounded"] else "; every probe met it: the capacity may be "
                        "higher (more --max-probes or more requests)"))
    return "\n".join(lines) + "\n"
