"""``vmemkv simulate``: run a workload through a memory policy on the cost model.

Defaults are the project's standard workload (docs/simulation.md): 2,000 requests at time 0,
prompts log-normal (median 584, p95 2,155), outputs log-normal (mean 374, p95 1,118), at most
4,096 tokens, Llama-3-8B on one H100, 60 GB of cache. The deployment flags are named for what
they are here (``--model-preset``, ``--gpu``): ``--model`` and ``--device`` mean a real model
and cpu/cuda in the other subcommands, so simulate refuses them with the new name.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace

from . import cli_capacity
from .cli_checks import (Given, GivenOnce, check_flags, check_lora, profile_defaults,
                         trace_requests)
from .cli_table import aggregate, format_table, parse_seeds, to_json
from .cliargs import (NON_NEGATIVE_INT, POSITIVE_INT, DistinctValues, bounded, hold_point,
                      non_empty_name, parse_bytes, write_stdout)
from .errors import ConfigError
from .managers.eviction import DEFAULT_EVICTION, EVICTION_POLICIES
from .presets import DEVICES, KV_CACHE_DTYPES, MODELS
from .profile_cost import load_profile, profile_model
from .progress import Progress
from .report import parse_goodput
from .scheduler import PREEMPTION_MODES, SchedulerConfig
from .geometry import LAYOUT_CHOICES
from .sim_config import DEFAULT_H2D_BYTES_PER_S, WATERMARK_SCOPES, SimConfig
from .sim_memory import check_adapters_fit, check_simulation_fits
from .simulator import POLICIES, simulate
from .traces import fit_to_length, scale_arrivals, trace_names
from .workload import (MAX_TRACE_TOKENS, WORKLOAD_RNGS, LoraSpec, WorkloadSpec, assign_adapters,
                       check_arrivals, generate, write_trace)

__all__ = ["parse_bytes", "register", "run", "format_table"]

TOKENS = bounded(float, 1, MAX_TRACE_TOKENS)   # a length distribution's median, mean or p95
# 10^6 GB (a petabyte) is far above any device or host: a larger value is a typo, and past
# ~1e299 GB its byte count overflows an int
MAX_GB = 1e6
GB, FRACTION = bounded(float, 0, MAX_GB), bounded(float, 0, 1)


TIMED = "with --profile: the profile's engine's"    # help: where a profile run's default is


class _Renamed(argparse.Action):
    """A flag that means something else in the other subcommands: refused with its new name."""

    def __init__(self, option_strings, dest, new: str = "", why: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.new, self.why = new, why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is {self.new} in simulate ({self.why})")


def policy_name(text: str) -> str:
    """argparse type of ``--policy``: a built-in policy or a custom ``module:Class``."""
    if text in POLICIES or ":" in text:
        return text
    raise argparse.ArgumentTypeError(f"want one of {', '.join(POLICIES)} or module:Class "
                                     f"(a MemoryManager subclass), got {text!r}")


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate a workload under a KV memory policy",
                              description="Run a workload through a KV memory policy on the "
                                          "roofline cost model; defaults: the standard workload.")
    _workload_flags(p.add_argument_group("workload (a generated one's flags are refused with --trace)"))
    _deployment_flags(p.add_argument_group("deployment"))
    s = p.add_argument_group("scheduler")
    s.add_argument("--watermark", type=FRACTION, default=0.01, action=Given,
                   help="fraction of the cache admission keeps free, in [0, 1)")
    s.add_argument("--watermark-scope", choices=WATERMARK_SCOPES, default="growing",
                   action=Given,
                   help="policies the watermark applies to: growing (paged, vmem: their "
                        "sequences grow into free memory; default) or all (reserve too)")
    s.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute",
                   help="what a preempted sequence loses: recompute its tokens, or swap them "
                        "to host memory (needs --swap-gb > 0)")
    s.add_argument("--swap-gb", type=GB, default=0.0, action=Given,
                   help="host swap space, GB (10^9 bytes)")
    s.add_argument("--max-running", type=POSITIVE_INT, default=1024, action=Given,
                   help=f"sequences per step (default: 1024; {TIMED} max_batch)")
    s.add_argument("--max-tokens-per-step", type=POSITIVE_INT, default=8192, action=Given,
                   help=f"new tokens per step (default: 8192; {TIMED} max_tokens_per_step)")
    c = p.add_argument_group("cost model")
    c.add_argument("--prefill-mfu", type=bounded(float, 0, 1, low_open=True), default=None,
                   help="cost prefill as compute-bound at this model-FLOPs utilisation, in "
                        "(0, 1] (default: bandwidth only)")
    c.add_argument("--map-latency-us", type=bounded(float, 0), default=0.0,
                   action=Given, help="microseconds per physical page mapped (vmem)")
    c.add_argument("--copy-gbps", type=bounded(float, 0, low_open=True), default=None,
                   action=Given,
                   help="device copy bandwidth for copy ops (a --trace's block-granular prefix "
                        "hits, copy-on-write after --n or --beam-width forks), GB/s (default: "
                        "half the GPU's memory bandwidth)")
    c.add_argument("--profile", metavar="FILE", default=None,
                   help="a device profile from vmemkv calibrate in place of the roofline (it "
                        "simulates its own model: --gpu and another --model-preset are "
                        "refused; the engine it timed gives the "
                        "defaults of --policy, --page-size, --layout, --max-running, "
                        "--max-tokens-per-step and --max-len; default: the roofline)")
    c.add_argument("--h2d-gbps", type=bounded(float, 0, low_open=True),
                   default=DEFAULT_H2D_BYTES_PER_S / 1e9,
                   action=Given,
                   help="host-device bandwidth for LoRA adapter loads and swap preemption's "
                        "copies, GB/s (default: 25, PCIe 4.0 x16 in practice)")
    c.add_argument("--paged-slowdown", type=bounded(float, 1, 1e6), default=1.0,
                   action=Given,
                   help="KV read-time multiplier for paged kernels, >= 1 (1: as fast as vmem)")
    cli_capacity.add_flags(p.add_argument_group("capacity search"))
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=None, action=DistinctValues,
                   help="latency targets for request_goodput, e.g. ttft:2000 tpot:200 "
                        "(DistServe's goodput: requests/s meeting every target; default: none)")
    o.add_argument("--json", action="store_true", help="one JSON object on stdout")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _workload_flags(w) -> None:
    w.add_argument("--requests", type=POSITIVE_INT, default=2000, action=Given,
                   help="number of requests")
    w.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, action=Given,
                   help="workload random seed")
    w.add_argument("--seeds", type=parse_seeds, metavar="0-4", default=None, action=GivenOnce,
                   help="run once per seed (FIRST-LAST or a comma list) and report mean ± std "
                        "(default: one run with --seed)")
    w.add_argument("--workload-rng", choices=WORKLOAD_RNGS, default="numpy",
                   action=Given,
                   help="numpy: the documented draw (default); python: the draw before issue 13")
    w.add_argument("--prompt-median", type=TOKENS, default=584.0, action=Given,
                   help="prompt length median, tokens")
    w.add_argument("--prompt-p95", type=TOKENS, default=2155.0, action=Given,
                   help="prompt length p95, tokens")
    w.add_argument("--output-mean", type=TOKENS, default=374.0, action=Given,
                   help="output length mean, tokens")
    w.add_argument("--output-p95", type=TOKENS, default=1118.0, action=Given,
                   help="output length p95, tokens")
    w.add_argument("--max-len", type=bounded(int, 2, 10**7), default=4096, action=Given,
                   help=f"max tokens per sequence (prompt + output clipped to it; longer trace "
                        f"requests are scaled down to it, prompt and output in proportion; "
                        f"default: 4096; {TIMED} max_context; vmem slots hold it in whole pages)")
    w.add_argument("--beam-width", type=bounded(int, 0), default=0,
                   help="every request a beam search of this many beams (0: plain decoding)")
    w.add_argument("--n", type=bounded(int, 1), default=1,
                   help="samples per request (parallel sampling: they share the prompt's memory)")
    w.add_argument("--beam-skew", type=bounded(float, 0), default=1.0,
                   action=Given,
                   help="how strongly a step's new beams descend from the best ones (0: evenly)")
    w.add_argument("--arrival-rate", type=bounded(float, 0), default=0.0,
                   action=Given, help="Poisson arrivals, requests/s (0: all at time 0)")
    w.add_argument("--trace", metavar="NAME|FILE", type=non_empty_name,
                   help=f"a bundled trace ({', '.join(trace_names())}) or a trace file "
                        f"(.csv Azure, .jsonl Mooncake or prompt_len/output_len/arrival_s, .gz) "
                        f"replayed with its arrival times (default: generate a workload)")
    w.add_argument("--rate-scale", type=bounded(float, 0, low_open=True), default=1.0,
                   help="with --trace: replay X times as fast (arrival times divided by X)")
    w.add_argument("--max-requests", type=POSITIVE_INT, default=None,
                   help="with --trace: keep the first N requests of the file, reading one "
                        "line further; those N+1 must be in arrival order (a line arriving "
                        "before the one above it is refused) (default: all)")
    w.add_argument("--write-trace", metavar="FILE",
                   help="also write the workload as a JSONL trace, once the run has finished "
                        "(a refused or interrupted run leaves FILE as it was) (default: don't)")
    w.add_argument("--lora-adapters", type=bounded(int, 0), default=0, metavar="N",
                   help="every request runs with one of N LoRA adapters (ranks 8-64, fp16, on "
                        "q/k/v/o), loaded into device memory on demand (0: no adapters; also "
                        "applies to a --trace whose requests name none)")
    w.add_argument("--lora-zipf", type=bounded(float, 0), default=1.0, metavar="ALPHA",
                   action=Given,
                   help="adapter popularity: the i-th most popular is picked with weight "
                        "i^-ALPHA (0: uniform; default 1, S-LoRA's power law)")


def _deployment_flags(m) -> None:
    m.add_argument("--model-preset", choices=sorted(MODELS), default="llama-3-8b", action=Given,
                   help="the model's shapes and weight bytes for the cost model")
    m.add_argument("--gpu", choices=sorted(DEVICES), default="h100", action=Given,
                   help="the GPU's bandwidth, FLOP/s and memory for the cost model")
    m.add_argument("--model", action=_Renamed, new="--model-preset",
                   why="elsewhere --model names a built-in model or a checkpoint")
    m.add_argument("--device", action=_Renamed, new="--gpu",
                   why="elsewhere --device is cpu or cuda")
    m.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="K/V storage: auto (the preset's dtype), bf16, fp16, fp8_e4m3, fp8_e5m2, "
                        "int8; bytes per token (capacity, the KV read of each step) follow it")
    m.add_argument("--cache-gb", type=bounded(float, 0, MAX_GB, low_open=True), default=60.0,
                   help="KV cache size, GB (10^9 bytes); with the weights, at most the GPU's memory")
    m.add_argument("--lora-budget-gb", type=bounded(float, 0, MAX_GB, low_open=True),
                   default=None,
                   help="with --lora-adapters (or a --trace naming adapters): a static split, "
                        "this many GB of --cache-gb for adapters and the rest for KV (default: "
                        "one pool both share)")
    m.add_argument("--policy", type=policy_name, default="paged", action=Given,
                   help=f"KV memory policy: {', '.join(POLICIES)}, or module:Class / "
                        f"file.py:Class for your own manager (docs/simulation.md; default: "
                        f"paged; {TIMED} cache)")
    m.add_argument("--block-size", type=POSITIVE_INT, default=16,
                   action=Given, help="tokens per block (paged), at most --max-len")
    m.add_argument("--page-bytes", "--page-size", dest="page_size", type=parse_bytes, metavar="SIZE",
                   default=2 * 2**20, action=Given,
                   help=f"bytes per physical page (vmem): 2MiB, 64KiB, 65536, ... (default: "
                        f"2MiB; {TIMED} page_bytes)")
    m.add_argument("--layout", choices=LAYOUT_CHOICES, default="per-layer", action=Given,
                   help=f"vmem: one page per layer (per-layer), all layers in one (interleaved), "
                        f"or auto: per-layer while its page group holds <= 128 tokens, else the "
                        f"layout with the smaller group (docs/usage.md; default: per-layer; "
                        f"{TIMED} layout)")
    m.add_argument("--prefix-block-tokens", type=bounded(int, 0), default=16, metavar="N",
                   action=Given,
                   help="vmem: prefix hits in blocks of N tokens whatever a page holds, the "
                        "hit's part of a page copied into the new sequence's page (0: whole "
                        "page groups only; with a --trace: a generated workload shares no "
                        "prefix)")
    m.add_argument("--prefix-eviction", choices=EVICTION_POLICIES, default=DEFAULT_EVICTION,
                   action=Given,
                   help="paged, vmem: keep computed prompt prefixes after their requests end "
                        "and evict them lru (vLLM's order) or hits (often-shared ones last); "
                        "off keeps none (prefixes are shared only when a --trace has hash "
                        "ids)")


def _entries(args, seed: int, say_scaled: bool = True):
    """The workload: a trace, or generated; with --lora-adapters an adapter per request.
    ``say_scaled``: say on stderr how many trace requests were scaled down to --max-len."""
    if args.lora_adapters:                    # the adapters are drawn after the lengths
        check_adapters_fit(args.lora_adapters, "lower --lora-adapters")
    entries = _lengths(args, seed, say_scaled)
    named = next((e for e in entries if e.adapter is not None), None) if args.lora_adapters else None
    if named is not None:        # the draw replaced the trace's own adapters, silently
        raise ConfigError(f"--lora-adapters {args.lora_adapters} draws an adapter for every "
                          f"request, and --trace {args.trace} names its own (a request at "
                          f"{named.arrival_s:g} s runs {named.adapter.name!r}): they would be "
                          f"replaced; leave --lora-adapters out to replay the trace's adapters")
    if args.lora_adapters:
        entries = assign_adapters(entries, LoraSpec(args.lora_adapters, args.lora_zipf, seed=seed),
                                  _config(args).model_spec)
    return entries


def _lengths(args, seed: int, say_scaled: bool = True):
    if args.trace:
        entries = scale_arrivals(trace_requests(args), args.rate_scale, args.trace,
                                 "--rate-scale")
        entries, scaled = fit_to_length(entries, args.max_len)
        if scaled and say_scaled:
            sys.stderr.write(f"vmemkv simulate: {scaled:,} of {len(entries):,} trace requests were "
                             f"longer than --max-len {args.max_len} tokens and were scaled down "
                             f"to it\n")
        return entries
    spec = WorkloadSpec(num_requests=args.requests, prompt_median=args.prompt_median,
                        prompt_p95=args.prompt_p95, output_mean=args.output_mean,
                        output_p95=args.output_p95, max_total_len=args.max_len,
                        arrival_rate=args.arrival_rate, seed=seed, rng=args.workload_rng)
    check_simulation_fits(args.requests, int(args.requests * min(args.output_mean, args.max_len)),
                          "lower --requests, --n or --beam-width", n=args.n,
                          beam_width=args.beam_width)   # the run's estimate, before a draw
    entries = generate(spec)
    check_arrivals(entries, f"--arrival-rate {args.arrival_rate:g}")
    return entries


def _config(args) -> SimConfig:
    sched = SchedulerConfig(max_running=args.max_running,
                            max_tokens_per_step=args.max_tokens_per_step,
                            watermark=args.watermark, preemption=args.preemption)
    return SimConfig(policy=args.policy, model=args.model_preset, device=args.gpu,
                     cache_bytes=int(args.cache_gb * 1e9), max_seq_len=args.max_len,
                     block_size=args.block_size, page_bytes=args.page_size, layout=args.layout,
                     swap_bytes=int(args.swap_gb * 1e9), scheduler=sched,
                     prefix_eviction=args.prefix_eviction,
                     prefill_mfu=args.prefill_mfu, map_latency_s=args.map_latency_us * 1e-6,
                     paged_slowdown=args.paged_slowdown, watermark_scope=args.watermark_scope,
                     prefix_block_tokens=args.prefix_block_tokens,
                     copy_bytes_per_s=None if args.copy_gbps is None else args.copy_gbps * 1e9,
                     profile=args.profile, kv_cache_dtype=args.kv_cache_dtype,
                     beam_width=args.beam_width, beam_skew=args.beam_skew, n=args.n,
                     adapter_budget_bytes=(None if args.lora_budget_gb is None
                                           else int(args.lora_budget_gb * 1e9)),
                     h2d_bytes_per_s=args.h2d_gbps * 1e9)


def _simulate(entries, config: SimConfig, args):
    """The simulation with its progress bar; Ctrl-C ends it with a note of how far it got
    (nothing is half-written: the result is printed only when every request has finished)."""
    enabled = None if not args.no_progress and len(entries) >= 200 else False
    finished = [0]

    def on_finished(n: int) -> None:
        finished[0] += n
        bar.update(n)
        hold_point("simulate")

    with Progress(len(entries), f"simulate {args.policy}", enabled=enabled) as bar:
        try:
            return simulate(entries, config, on_finished=on_finished)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"{finished[0]:,} of {len(entries):,} requests had finished; "
                                    f"no result written") from None


def run(args) -> int:
    check_lora(args)                # before the config's check of the same, naming the flags
    outside = profile_defaults(args)   # the profile's engine fills the flags not given
    config = _config(args)          # field checks first: they name the flag the user gave
    check_flags(args)               # then the flags together, before anything is drawn
    for line in outside:
        sys.stderr.write(f"vmemkv simulate: warning: {line}\n")
    goodput = parse_goodput(args.goodput) if args.goodput else None
    vars(args).setdefault("trace_read", {})   # trace_requests: shared by the probes' copies
    if args.find_max_rate:        # say how many trace requests were scaled down at the first
        probes = itertools.count()    # probe only (a load scales arrivals); it was never said
        return cli_capacity.run(args, config,
                                lambda a: _entries(a, a.seed, say_scaled=next(probes) == 0))
    seeds = args.seeds or [args.seed]
    runs = []
    for seed in seeds:
        entries = _entries(args, seed)
        result = _simulate(entries, replace(config, beam_seed=seed), args)   # beams: per seed
        if args.write_trace is not None:      # one seed (check_together); once the run has
            _write_trace(args.write_trace, entries)   # passed simulate's checks and finished
        out = result.to_dict()
        if goodput:
            out.update(result.report(goodput))
        out["config"] = _echo(args, seed)
        runs.append(out)
    _print(runs, seeds, args)
    return 0


def _write_trace(path: str, entries) -> None:
    try:
        write_trace(path, entries)
    except OSError as error:      # checked before the draw; a full disk is still possible
        raise ConfigError(f"--write-trace {path}: {error.strerror or error}") from None


# the flags echoed under their own names in a run's "config" (units in the name where the flag
# has them); page_size, the one in bytes whose flag does not say so, is echoed as page_size_bytes
ECHOED_FLAGS = (
    "model_preset", "gpu", "cache_gb", "policy", "block_size", "layout", "watermark",
    "watermark_scope", "preemption", "swap_gb", "max_running", "max_tokens_per_step", "max_len",
    "seed", "workload_rng", "trace", "goodput", "profile", "prefix_eviction", "prefix_block_tokens",
    "lora_adapters", "lora_zipf", "lora_budget_gb", "h2d_gbps", "kv_cache_dtype", "n",
    "beam_width", "beam_skew", "prefill_mfu", "map_latency_us", "copy_gbps", "paged_slowdown")


def _echo(args, seed: int) -> dict:
    """Every flag that shaped one run, ``seed`` the one it drew its workload with; the
    generated workload's flags are None with --trace (ignored), the trace's without it."""
    echo = {k: getattr(args, k) for k in ECHOED_FLAGS}
    echo.update(seed=seed, page_size_bytes=args.page_size)
    generated = {"requests": args.requests, "arrival_rate_per_s": args.arrival_rate,
                 "prompt_median_tokens": args.prompt_median, "prompt_p95_tokens": args.prompt_p95,
                 "output_mean_tokens": args.output_mean, "output_p95_tokens": args.output_p95}
    replayed = {"rate_scale": args.rate_scale, "max_requests": args.max_requests}
    echo.update(dict.fromkeys(generated) if args.trace else generated)
    echo.update(replayed if args.trace else dict.fromkeys(replayed))
    if args.profile:                # its model was simulated, on no preset GPU
        echo.update(model_preset=None, gpu=None,
                    profile_model=profile_model(load_profile(args.profile)).name)
    return echo


def _print(runs: list, seeds: list, args) -> None:
    if len(runs) == 1:
        text = to_json(runs[0]) if args.json else format_table(runs[0])
    else:
        stats = aggregate(runs)
        config = {k: v for k, v in runs[0]["config"].items() if k != "seed"}
        summary = dict(stats["mean"], policy=runs[0]["policy"], config=config)
        text = (to_json({"seeds": seeds, **stats, "runs": runs}) if args.json
                else format_table(summary, stats["std"], seeds, stats.get("counts")))
    write_stdout(text.rstrip("\n") + "\n")
