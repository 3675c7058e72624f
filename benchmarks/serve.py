"""``vmemkv bench serve``: load an OpenAI-compatible server open-loop and report what
``vllm bench serve`` reports, with its names, through ``scheduler/report.py`` (the same code as
the simulator and ``vmemkv bench``): a table, DIR/serve.json and DIR/serve.png (``--out DIR``
checked before any request is sent: a folder we can write both files in).

    vmemkv bench serve --url http://127.0.0.1:8000 --rate 4 --num-prompts 64
    vmemkv bench serve --url http://127.0.0.1:8000 --trace azure-conv --max-requests 100
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import NON_NEGATIVE_INT, DistinctValues, bounded
from vmemkv.scheduler.report import check_percentiles, parse_goodput, serving_report
from vmemkv.scheduler.result_files import folder_problem
from vmemkv.scheduler.traces import trace_names

from .common import exit_status, format_table, write_json
from .plots import _pyplot, _save

TABLE_METRICS = ("ttft", "tpot", "itl", "e2el")
OUTPUTS = ("serve.json", "serve.png")     # what a run writes in --out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="load an OpenAI-compatible server open-loop; vllm bench serve's figures",
        description="Send streaming completions to an OpenAI-compatible server at Poisson or "
                    "trace arrival times and report request/token throughput and TTFT, TPOT, "
                    "ITL, E2EL (mean, median, percentiles) as a table, serve.json and serve.png."
                    "\n\nexample:\n  vmemkv bench serve --url http://127.0.0.1:8000 --rate 4")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to send (default: the first that "
                   "GET /v1/models lists)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=_rate, default=None,
                      help="Poisson arrivals, requests/s (inf: all at once) (default: unset)")
    load.add_argument("--trace", default=None, help=f"replay a trace's arrivals: one of "
                      f"{', '.join(trace_names())} or a trace file (default: unset)")
    p.add_argument("--num-prompts", type=bounded(int, 1), default=32, help="--rate: requests")
    p.add_argument("--input-len", type=bounded(int, 1), default=32, help="--rate: prompt tokens")
    p.add_argument("--output-len", type=bounded(int, 1), default=16, help="--rate: output tokens")
    p.add_argument("--max-requests", type=bounded(int, 1), default=64, help="--trace: the first N")
    p.add_argument("--rate-scale", type=bounded(float, 0, low_open=True), default=1.0,
                   help="--trace: replay X times as fast")
    p.add_argument("--max-total-len", type=bounded(int, 2), default=256,
                   help="--trace: longer requests are scaled down to this many tokens")
    p.add_argument("--vocab-size", type=bounded(int, 2), default=256,
                   help="prompt token ids are drawn from [0, N)")
    p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, help="prompt tokens and Poisson gaps")
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS", action=DistinctValues,
                   help="SLO targets for request_goodput, e.g. ttft:500 tpot:50 (default: none)")
    p.add_argument("--percentiles", type=bounded(float, 0, 100), nargs="+", default=[90.0, 99.0],
                   action=DistinctValues,
                   help="percentiles to report")
    p.add_argument("--label", default=None, help="a name for this run in the JSON and the plot, e.g. vmem (default: none)")
    p.add_argument("--out", default="bench_out", metavar="DIR", help="folder for serve.json and serve.png")
    p.add_argument("--no-plots", action="store_true", help="skip serve.png")


def _rate(text: str) -> float:
    """requests/s > 0, or ``inf`` (every request at time 0, as vllm bench serve takes it)."""
    return math.inf if text.strip().lower() == "inf" else bounded(float, 0, low_open=True)(text)


def run(args: argparse.Namespace) -> int:
    import asyncio

    problem = out_problem(args.out)     # before the load: its figures were lost after it
    if problem:
        from vmemkv.cli import UsageError
        raise UsageError(f"--out {problem}")
    from vmemkv.runtime.serve import bench_client as client
    from vmemkv.runtime.serve.server import require_serve_extra
    require_serve_extra()
    goodput = parse_goodput(args.goodput)
    check_percentiles(args.percentiles, "--percentiles")   # before the load, not after it
    requests = (client.poisson_requests(args.rate, args.num_prompts, args.input_len,
                                        args.output_len, args.vocab_size, args.seed)
                if args.trace is None else
                client.trace_requests(args.trace, args.max_requests, args.rate_scale,
                                      args.max_total_len, args.vocab_size, args.seed))
    model = args.model or client.served_model(args.url)
    timings, errors, duration_s = asyncio.run(client.run_load(args.url, model, requests))
    report = serving_report(timings, duration_s=duration_s, goodput_ms=goodput,
                            percentiles=args.percentiles)
    report["failed"] = len(errors)
    payload = {"label": args.label, "url": args.url, "model": model,
               "load": f"trace {args.trace}" if args.trace else f"poisson {args.rate}/s",
               "requests": len(requests), "report": report, "errors": errors[:10],
               "ttft_ms": sorted(t.ttft_s * 1e3 for t in timings),
               "e2el_ms": sorted(t.e2el_s * 1e3 for t in timings)}
    print(format_report(payload, args.percentiles))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "serve.json"), _finite(payload))
    if not args.no_plots and timings:
        _plot_or_skip(payload, os.path.join(args.out, "serve.png"))
    if errors:
        sys.stderr.write(f"vmemkv bench serve: {len(errors)} of {len(requests)} requests failed; "
                         f"first: {errors[0]}\n")
        return 1
    return 0


def _plot_or_skip(payload: dict, path: str) -> None:
    """serve.png, or one line naming the bench extra when matplotlib is missing (serve.json is
    written already: the load is not lost to a missing plotting library)."""
    from vmemkv.cli import missing_extra
    try:
        print(f"# wrote {plot(payload, path)}")
    except ModuleNotFoundError as error:
        line = missing_extra(error)
        if line is None:
            raise
        print(f"# plots skipped: {line}")


def out_problem(path: str) -> Optional[str]:
    """Why serve.json and serve.png cannot be written into the folder ``path``, or None
    (``result_files.folder_problem``; an empty name too)."""
    return "needs a folder name, got ''" if not path else folder_problem(path, OUTPUTS)


def format_report(payload: dict, percentiles) -> str:
    """vllm bench serve's summary: the totals, then one row per latency metric (ms)."""
    r = payload["report"]
    label = f"{payload['label']}: " if payload["label"] else ""
    head = (f"# bench serve {label}{payload['model']} @ {payload['url']}, "
            f"{payload['load']}: {r['completed']} completed, {r['failed']} failed in "
            f"{r['duration']:.2f} s\n# request_throughput {r['request_throughput']:.2f} req/s | "
            f"output_throughput {r['output_throughput']:.1f} tok/s | total_token_throughput "
            f"{r['total_token_throughput']:.1f} tok/s")
    if "request_goodput" in r:
        head += f" | request_goodput {r['request_goodput']:.2f} req/s"
    columns = ["metric", "mean", "median"] + [f"p{q:g}" for q in percentiles]
    rows = [{"metric": f"{m} ms", "mean": r[f"mean_{m}_ms"], "median": r[f"median_{m}_ms"],
             **{f"p{q:g}": r[f"p{q:g}_{m}_ms"] for q in percentiles}} for m in TABLE_METRICS]
    return head + "\n" + format_table(rows, columns)


def plot(payload: dict, path: str) -> str:
    """CDFs of TTFT and E2EL per request (ms, log x)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for key, colour in (("ttft_ms", "tab:blue"), ("e2el_ms", "tab:orange")):
        xs = payload[key]
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=colour,
                label=key.replace("_ms", "").upper())
    ax.set_xscale("log")
    ax.set_xlabel("ms (client clock)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{payload['label'] or payload['model']}: {payload['load']}")
    ax.legend()
    return _save(fig, plt, path)


def _finite(obj):
    """JSON has no NaN: a figure with no samples becomes null."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def main(argv=None) -> int:
    """``python -m vmemkv.benchmarks.serve --url URL --rate 4``: ``vmemkv bench serve``'s flags
    and run, as every benchmark script runs on its own (it did nothing and exited 0)."""
    parser = OneLineArgumentParser(prog="python -m vmemkv.benchmarks")
    register(parser.add_subparsers(dest="bench_command", parser_class=OneLineArgumentParser))
    return run(parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(exit_status("serve", main))
