"""``vmemkv bench``: the head-to-head suite -- VMM or paged, and at what cost.

Runs vmemkv.benchmarks.suite on the default device (CUDA when present, else the CPU):
allocation, attention, memory, engine. Writes every figure to DIR/bench.json, what each section
printed to DIR/bench.log and PNG plots to DIR; prints an aligned summary table at the end (with
a warning when the machine was busy). Ctrl-C writes bench.json and bench.log with the sections
that finished and exits 130. Without the hf extra (transformers), a run that includes an engine
section is refused before any section runs, naming the extra (exit 2). The command line sits
above the layers, so importing the benchmarks here is no upward import.
"""
from __future__ import annotations

import argparse
import sys

from vmemkv.cli import UsageError, missing_extra
from vmemkv.runtime.generate_cli import check_tp_devices, tp_device_list
from vmemkv.scheduler.cliargs import DistinctValues, bounded, thread_count
from vmemkv.scheduler.presets import KV_CACHE_DTYPE_BYTES, KV_CACHE_DTYPES

SECTIONS = ("alloc", "attention", "memory", "engine")
ENGINE_SECTIONS = ("engine", "tp")     # run vmemkv.runtime.engine (transformers: the hf extra)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="run the vmem-vs-paged benchmark suite (JSON, plots, summary table)",
        description="Run the vmem-vs-paged benchmark suite: allocation, attention, memory and "
                    "engine sections, a summary table, bench.json, bench.log and PNG plots.\n\n"
                    "example:\n  vmemkv bench --quick --out bench_out")
    parser.add_argument("--quick", action="store_true",
                        help="the short suite (under a minute on a 2-core CPU)")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes that only check the plumbing (JSON, log, plots, summary) "
                             "in seconds; the figures mean nothing; implies --quick")
    parser.add_argument("--out", dest="suite_out", default="bench_out", metavar="DIR",
                        help="output folder for bench.json, bench.log and the PNGs "
                             "(matplotlib: the bench extra)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="torch device (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=None, metavar="SECTION",
                        action=DistinctValues,
                        help=f"run only these sections ({', '.join(SECTIONS)}) (default: all)")
    parser.add_argument("--threads", type=thread_count, default=None, metavar="N",
                        help="torch CPU threads for the whole suite, 1 to this machine's CPU count "
                             "(default: torch's choice; 1 gives steady CPU timings on a small, "
                             "shared machine)")
    parser.add_argument("--tp", type=bounded(int, 2), default=None, metavar="N",
                        help="also run the tensor-parallel section: TP=1 against TP=N engine "
                             "tokens/s (N >= 2 ranks: gloo on the CPU, one GPU each with "
                             "--device cuda) (default: not run)")
    parser.add_argument("--tp-devices", type=tp_device_list, default=None, metavar="DEVICES",
                        help="with --tp N on a GPU: the devices of the TP=N row's ranks, "
                             "comma-separated, cuda:0 first (e.g. cuda:0,cuda:2) (default: "
                             "cuda:0..cuda:N-1)")
    parser.add_argument("--prefix-eviction", choices=("lru", "hits"), default=None,
                        help="also time prefix retention end to end (benchmarks/prefix.py, "
                             "short): multi-turn chats with this policy against retention off "
                             "on vmem and paged; prints the speed-up, writes DIR/prefix.json "
                             "(default: not run)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the engine section's K/V storage (auto: the model's dtype; 8-bit: "
                             "CPU only), every engine system alike; transformers keeps its own")
    parser.add_argument("--no-plots", dest="suite_no_plots", action="store_true",
                        help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    from vmemkv.benchmarks import serve   # ``vmemkv bench serve``: load an HTTP server
    serve.register(parser.add_subparsers(dest="bench_command", metavar="serve", required=False,
                                         parser_class=type(parser),
                                         help="serve: load an OpenAI-compatible server "
                                              "(default: the suite)"))


def _prefix(args: argparse.Namespace, device_name: str) -> None:
    """benchmarks/prefix.py's short workload: ``off`` against the chosen policy (the device
    the suite picked: cuda when visible, else cpu)."""
    import os
    import torch
    from vmemkv.benchmarks import prefix
    from vmemkv.benchmarks.common import busy_warnings, environment, format_table, write_json
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(prefix.SEED, 1, 1, device, model=prefix.MODEL, quick=True,
                      load_1min=round(os.getloadavg()[0], 2))   # as prefix.py's own run
    rows = prefix.run(quick=True, device=device, warmup=1, repeats=1,
                      policies=[args.prefix_eviction])
    print(format_table(rows, prefix.COLUMNS))
    write_json(os.path.join(args.suite_out, "prefix.json"),
               {"device": device_name, "environment": env, "rows": rows,
                "warnings": busy_warnings(env["load_1min"])})


def _check_engine_importable(args: argparse.Namespace, sections) -> None:
    """The engine sections (and --prefix-eviction) need vmemkv.runtime.engine, which needs
    the hf extra: without it, UsageError naming the extra (exit 2) before any section runs,
    not a row ``engine | not run | ModuleNotFoundError`` after the others."""
    needing = [s for s in sections if s in ENGINE_SECTIONS]
    needing += ["--prefix-eviction"] if args.prefix_eviction else []
    if not needing:
        return
    try:
        import vmemkv.runtime.engine  # noqa: F401
    except ModuleNotFoundError as error:
        line = missing_extra(error)
        if line is None:
            raise
        runnable = " ".join(s for s in sections if s not in ENGINE_SECTIONS)
        hint = f"; --only {runnable} runs without it" if runnable else ""
        raise UsageError(f"{line} ({', '.join(needing)} needs it{hint})") from None


def _check_out_and_tp(args: argparse.Namespace) -> None:
    """Before any section runs: --out must be a folder the suite can write in (``''`` ran the
    suite, then ended in a FileNotFoundError), and --tp a rank count the tensor-parallel
    section's model can be sharded into (TP=3 on its 8 heads ran the whole suite, then failed
    the section: exit 1); UsageError naming the flag (exit 2)."""
    from vmemkv.benchmarks.suite import OUTPUTS
    from vmemkv.scheduler.cli_sweep import out_folder_problem
    problem = out_folder_problem(args.suite_out, OUTPUTS)
    if problem:
        raise UsageError(f"--out {problem}")
    if args.tp is None:
        return
    from vmemkv.benchmarks import tp
    from vmemkv.runtime.distributed import TensorParallelConfigError
    from vmemkv.runtime.distributed.sharding import check_tensor_parallel
    from vmemkv.runtime.models import build_model
    try:
        check_tensor_parallel(build_model(tp.MODEL, seed=tp.SEED), args.tp)
    except TensorParallelConfigError as error:
        raise UsageError(f"--tp {args.tp}: the tensor-parallel section's model ({tp.MODEL}) "
                         f"cannot run {args.tp} ranks: {error}") from None


# the suite's flags that ``bench serve`` does not read, with the value that means "not given"
SUITE_ONLY_FLAGS = {"quick": False, "smoke": False, "device": None, "only": None, "threads": None,
                    "tp": None, "tp_devices": None, "prefix_eviction": None,
                    "kv_cache_dtype": "auto", "no_progress": False,
                    # stored apart from serve's own --out / --no-plots, which argparse's
                    # subcommand defaults overwrote: given before 'serve', they were dropped
                    "suite_out": "bench_out", "suite_no_plots": False}


def _check_applies(args: argparse.Namespace) -> None:
    """A flag given where it would do nothing (docs/usage.md: refused, not ignored):
    UsageError naming it (exit 2), before anything runs. ``bench serve`` loads a server and
    runs no suite; --kv-cache-dtype sets the engine section's cache only."""
    if getattr(args, "bench_command", None) == "serve":
        for dest, absent in SUITE_ONLY_FLAGS.items():
            if getattr(args, dest) != absent:
                flag = dest.removeprefix("suite_").replace("_", "-")
                raise UsageError(f"--{flag} is a flag of the suite; 'vmemkv "
                                 f"bench serve' runs no suite and would ignore it: drop it, or "
                                 f"give serve's own flags after 'serve'")
    elif args.kv_cache_dtype != "auto" and args.only is not None and "engine" not in args.only:
        raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} sets the engine section's cache "
                         f"and --only {' '.join(args.only)} runs no engine section: add engine "
                         f"to --only or drop it")


def _check_kv_cache_dtype_device(args: argparse.Namespace) -> None:
    """An 8-bit --kv-cache-dtype on the GPU the suite runs on (--device cuda, or a visible GPU
    by default): no CUDA attention reads 8-bit K/V, so the engine section could only fail, after
    the sections before it had run for minutes (exit 1); UsageError naming both (exit 2)."""
    if KV_CACHE_DTYPE_BYTES[args.kv_cache_dtype] != 1 or args.device == "cpu":
        return
    import torch
    if args.device == "cuda" or torch.cuda.is_available():
        given = "--device cuda" if args.device == "cuda" else "a visible GPU (the default device)"
        raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} runs on the CPU only (no CUDA "
                         f"attention reads 8-bit K/V) and the suite runs on {given}: give "
                         f"--device cpu, or auto, bf16 or fp16")


def run(args: argparse.Namespace) -> int:
    _check_applies(args)
    if getattr(args, "bench_command", None) == "serve":
        from vmemkv.benchmarks import serve
        return serve.run(args)
    _check_out_and_tp(args)
    if args.tp_devices is not None:     # before the GPU check: a CPU run names the flag
        import torch
        check_tp_devices(args.tp_devices, args.tp, args.device or (
            "cuda" if torch.cuda.is_available() else "cpu"), error=UsageError)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--device cuda but torch sees no CUDA GPU")
    _check_kv_cache_dtype_device(args)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    from vmemkv.benchmarks import smoke, suite
    if args.smoke:
        smoke.apply()
    sections = tuple(s for s in SECTIONS if s in (args.only or SECTIONS))
    if args.tp is not None:
        sections += ("tp",)
    _check_engine_importable(args, sections)
    payload = suite.run_suite(quick=args.quick or args.smoke, out_dir=args.suite_out, device=args.device,
                              sections=sections, plots=not args.suite_no_plots,
                              progress=not args.no_progress,
                              options={"tp": dict(world=args.tp or 2, tp_devices=args.tp_devices),
                                       # only when asked: engine.run may be a stand-in
                                       "engine": {} if args.kv_cache_dtype == "auto" else
                                       dict(kv_cache_dtype=args.kv_cache_dtype)})
    size = (" --smoke (toy sizes: the figures mean nothing)" if args.smoke
            else " --quick" if args.quick else "")
    print(f"\n# vmemkv bench{size}: {payload['environment']['device']}, "
          f"torch {payload['environment']['torch']}, {payload['wall_s']:.1f} s")
    print(suite.format_summary(payload["summary"]))
    for warning in payload["warnings"]:
        print(f"# WARNING: {warning}")
    print(f"# wrote {payload['json']}" + "".join(f"\n# wrote {p}" for p in payload["plots"]))
    if args.prefix_eviction:
        _prefix(args, payload["environment"]["device"])
    failed = [s for s in sections if "error" in payload.get(s, {})]
    if failed:
        sys.stderr.write(f"vmemkv bench: sections failed: {', '.join(failed)} (see {args.suite_out}/bench.log)\n")
        return 1
    return 0
