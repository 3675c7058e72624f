"""Attention time on the real vmem and paged caches, each with the fastest backend for the device.

    python benchmarks/attention.py                 # CPU: scaled-down defaults, < 3 min
    python benchmarks/attention.py --quick         # smoke run, seconds
    python benchmarks/attention.py --device cuda   # fp16, full prefill, Llama-3-8B heads
    python benchmarks/attention.py --out results/attention.json
    python benchmarks/attention.py --configs 8x2048 32x4096 --flush-mib 64 \
        --vmem-layout per-layer interleaved --dtype float32 bfloat16
    python benchmarks/attention.py --configs 8x2048 32x4096 --phases decode \
        --kv-cache-dtype auto bf16 fp8_e4m3        # K/V stored 4, 2, 1 bytes; fp32 queries

One line per configuration: cache | phase | backend | batch | ctx | q | ms | GB/s | GFLOP/s |
% yardstick | % copy | % FMA peak. Each row reports its share of a yardstick for its phase, measured
first in the same run (``benchmarks/yardstick.py``; a measurement of this run, not a hardware
limit: it moves between runs and drops when other jobs share the machine; a decode row above
100% of it is flagged UNRELIABLE, and a 1-minute load >= half the cores ends the run with a
``# WARNING``, both also in ``warnings`` in the JSON): decode against the **read** bandwidth
(decode only reads K/V; GB/s counts every live token's K and V once, so a paged gather shows
up as lower GB/s for the same bytes), prefill against fp32 (CUDA: fp16) **matmul** FLOP/s
(GFLOP/s counts 2 x 2 flops per visible query-key pair and head dim: q.k and p.v). "% copy"
divides GB/s by the copy bandwidth (read + write), the yardstick before issue 33; "% FMA peak"
(CPU) divides GFLOP/s by the native FMA loop's, the arithmetic roof (torch's matmul may sit
below it, and a prefill kernel above the matmul).

``--vmem-layout per-layer interleaved`` times both vmem layouts in one run (the interleaved
cache holds ``--layers`` layers so its layer view is strided; rows ``vmem interleaved``).
``--baselines`` (CPU default: ``sdpa``, the per-request path) times more backends on the same
views, alternating with the fastest; they go to ``baselines`` in the JSON, with their time over
the fastest backend's in ``baseline_ratios``. A baseline may carry backend options,
``name:key=value,...`` (integers or ``None``): ``cpu-varlen:work_units=1`` is the kernel with its
key ranges never split. ``--flush-mib`` reads that many MiB between timed calls so every call
reads its K/V from memory. The goals of issues 4, 28 and 33 are checked at the end
(``goals`` in the JSON, see benchmarks/attention_goals.py).

Storage: the real caches (benchmarks/attention_caches.py), one layer timed. The same K/V go
into every cache; every output is checked against the first (vmem, fastest backend) before
anything is timed. Each timed call is ``backend.forward(q, cache.layer_view(0))``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from vmemkv.benchmarks import yardstick
from vmemkv.benchmarks.alloc import refuse_missing_cuda
from vmemkv.benchmarks.attention_caches import build_caches, bytes_needed, labels
from vmemkv.benchmarks.attention_goals import (goals, over_yardstick, print_goals, run_warnings,
                                               speedups, target_check)
from vmemkv.benchmarks.common import environment, exit_status, flags_given, print_environment
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.result_files import write_json
from vmemkv.runtime.attention import fastest_backend, get_backend
from vmemkv.runtime.errors import CacheTooLargeError
from vmemkv.runtime.memory import check_fits_device
from vmemkv.runtime.kv_dtype import KV_CACHE_DTYPES
from vmemkv.scheduler.cliargs import (NON_NEGATIVE_INT, POSITIVE_INT, DistinctValues, batch_by_ctx, result_file,
                                      thread_count)

# CPU: 8k contexts at batch 32 alone would take minutes on a small host; 4k is the top here.
CPU_DEFAULTS = dict(batches=[1, 8, 32], contexts=[512, 2048, 4096], heads=32, kv_heads=8,
                    head_dim=128, prefill_len=16, repeats=5)
QUICK = dict(batches=[1, 8], contexts=[512, 2048], heads=32, kv_heads=8, head_dim=128,
             prefill_len=16, repeats=3)
CUDA_DEFAULTS = dict(batches=[1, 8, 32], contexts=[512, 2048, 8192], heads=32, kv_heads=8,
                     head_dim=128, prefill_len=0, repeats=20)   # prefill_len 0: whole prompt
PHASES = ("decode", "prefill")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUICK_YARDSTICK = dict(nbytes=64 << 20)   # --quick on the CPU: 64 MiB read and copied


def timer(device: torch.device):
    """Returns time_fn(fn) -> seconds, synchronising the device around the call."""
    def run(fn):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); fn(); end.record(); torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter(); fn()
        return time.perf_counter() - t0
    return run


def sample_times(fns, device, warmup: int, repeats: int, between=None) -> list[list[float]]:
    """Every timed call's seconds, per fn (``repeats`` each, after ``warmup``), alternating;
    ``between()``, if given, runs untimed before every call."""
    run = timer(device)
    for _ in range(warmup):
        for fn in fns:
            run(fn)
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            if between:
                between()
            out.append(run(fn))
    return samples


def cache_flusher(device, mib: int):
    """A call that reads ``mib`` MiB (untimed: K/V then come from memory, whatever the order of
    the variants), or None for 0. Without it a variant timed right after another on the same
    cache finds the K/V the other left in the last-level cache (a 15 MB cache in a 32 MiB L3).
    It reads rather than writes: written lines would be written back to memory during the
    next timed call, taking bandwidth from it."""
    if not mib:
        return None
    junk = torch.zeros((mib << 20) // 4, device=device)
    return lambda: junk.sum()


def run_configs(caches, names, phase, batch, ctx, qlen, q, args, device, limits) -> list[dict]:
    """Check every output against the first of its kv_cache_dtype (vmem, fastest backend), then
    time them all, alternating: per cache its fastest backend, then each baseline (caches of
    several kv_cache_dtypes alternate too, so a noisy neighbour hits them alike). Rows in that
    order, each with ``baseline`` saying which it is; GB/s counts the bytes stored."""
    calls, tags, outs = [], [], []
    for cache, label in zip(caches, names):
        cache.begin_step([(seq, ctx - qlen, qlen) for seq in range(batch)])
        view = cache.layer_view(0)
        fastest = fastest_backend(cache.kind, device.type, block_size=args.block_size, dtype=q.dtype,
                                  kv_dtype=cache.config.storage_dtype)
        for name in [fastest] + [b for b in args.baselines if b != fastest]:
            backend = backend_of(name)
            outs.append(backend.forward(q, view))   # first call: lazy imports, one-time warnings
            tags.append((label, name, name != fastest, cache.config))
            calls.append(lambda b=backend, v=view: b.forward(q, v))
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    first = {}
    for out, tag in zip(outs, tags):
        ref, ref_tag = first.setdefault(tag[3].kv_cache_dtype, (out, tag))
        try:
            torch.testing.assert_close(ref.float(), out.float(), atol=tol, rtol=tol)
        except AssertionError as error:   # a wrong kernel or layout: name both, not only values
            raise AssertionError(f"{phase} batch {batch} ctx {ctx}: {tag[0]} with {tag[1]} differs "
                                 f"from {ref_tag[0]} with {ref_tag[1]}: {error}") from None
    samples = sample_times(calls, device, args.warmup, args.repeats,
                           cache_flusher(device, args.flush_mib))
    flops = 4 * batch * args.heads * args.head_dim * sum(ctx - qlen + p + 1 for p in range(qlen))
    limit = "read" if phase == "decode" else "matmul"
    rows = []
    for (label, name, baseline, config), times in zip(tags, samples):
        kv, t = config.kv_cache_dtype, statistics.median(times)
        kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * config.element_bytes
        share = kv_bytes / t / 1e9 / limits["read_gb_per_s"] if limit == "read" else \
            flops / t / 1e9 / limits["matmul_gflop_per_s"]
        rows.append({"cache": label, "dtype": str(q.dtype).replace("torch.", ""),
                     "kv_cache_dtype": kv,
                     "phase": phase, "backend": name, "batch": batch,
                     "ctx": ctx, "query_len": qlen, "ms": t * 1e3, "ms_min": min(times) * 1e3,
                     "ms_max": max(times) * 1e3, "kv_gb_per_s": kv_bytes / t / 1e9,
                     "gflop_per_s": flops / t / 1e9, "limit": limit, "pct_limit": 100 * share,
                     "pct_fma_peak": 100 * flops / t / 1e9 / limits["fma_peak_gflop_per_s"]
                     if "fma_peak_gflop_per_s" in limits else None,
                     "pct_copy": 100 * kv_bytes / t / 1e9 / limits["copy_gb_per_s"],
                     "checked": True, "baseline": baseline})
    return rows


def backend_of(spec: str):
    """A backend from ``name`` or ``name:key=value,...`` (values: integers or ``None``)."""
    name, _, opts = spec.partition(":")
    kwargs = {}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        kwargs[key] = None if value == "None" else int(value)
    return get_backend(name, **kwargs)


def baseline_ratios(rows: list[dict], baselines: list[dict]) -> list[dict]:
    """Baseline ms / fastest ms per (cache, phase, batch, ctx, baseline): > 1, the fastest wins."""
    key = lambda r: (r["cache"], r["phase"], r["batch"], r["ctx"], r["dtype"],  # noqa: E731
                     r.get("kv_cache_dtype", "auto"))
    fastest = {key(r): r for r in rows}
    out = []
    for b in baselines:
        r = fastest[key(b)]
        out.append({"cache": b["cache"], "phase": b["phase"], "batch": b["batch"], "ctx": b["ctx"],
                    "dtype": b["dtype"],
                    "baseline": b["backend"], "backend": r["backend"],
                    "baseline_over_backend": b["ms"] / r["ms"]})
    return out


def fmt(r) -> str:
    kv = r.get("kv_cache_dtype", "auto")
    cache = r["cache"] + ("" if kv == "auto" else f" kv {kv}")
    return (f"{cache:<16}| {r['phase']:<8}| {r['backend']:<10}| {r['batch']:>5} | {r['ctx']:>6} | "
            f"{r['query_len']:>5} | {r['ms']:>9.3f} | {r['kv_gb_per_s']:>7.2f} | {r['gflop_per_s']:>7.1f} | "
            f"{r['pct_limit']:>5.1f}% {r['limit']:<6} | {r['pct_copy']:>6.1f}% | "
            + (f"{r['pct_fma_peak']:>5.1f}%" if r["pct_fma_peak"] is not None else "")
            + ("  UNRELIABLE: > 100% of the measured read" if over_yardstick(r) else ""))


HEADER = ("cache           | phase   | backend   | batch |    ctx |     q |        ms |    GB/s | "
          "GFLOP/s | % yardstick  | % copy  | % FMA peak")


def ratio_line(now: list[dict]) -> str:
    """Each cache's time over vmem per-layer's, and each baseline's over its cache's fastest
    (of the run's first kv_cache_dtype)."""
    kv = now[0].get("kv_cache_dtype", "auto")
    now = [r for r in now if r.get("kv_cache_dtype", "auto") == kv]
    fastest = {r["cache"]: r for r in now if not r["baseline"]}
    first = next(iter(fastest.values()))
    parts = [f"{c}/{first['cache']} {r['ms'] / first['ms']:.2f}x" for c, r in fastest.items()
             if r is not first]
    parts += [f"{r['backend']}/{fastest[r['cache']]['backend']} {r['cache']} "
              f"{r['ms'] / fastest[r['cache']]['ms']:.2f}x" for r in now if r["baseline"]]
    return f"{'':6}  time ratios: " + "; ".join(parts)


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"), help="cpu or cuda (default: cuda when present)")
    p.add_argument("--quick", action="store_true", help="smallest useful run")
    p.add_argument("--batches", type=POSITIVE_INT, nargs="+", action=DistinctValues)
    p.add_argument("--contexts", type=POSITIVE_INT, nargs="+", action=DistinctValues)
    p.add_argument("--configs", type=batch_by_ctx, nargs="+", metavar="BATCHxCTX", action=DistinctValues,
                   help="(batch, context) pairs, e.g. 1x8192 8x2048, instead of the grid "
                        "--batches x --contexts")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), action=DistinctValues)
    p.add_argument("--flush-mib", type=NON_NEGATIVE_INT, default=0,
                   help="read this many MiB between timed calls (untimed) so every call "
                        "reads K/V from memory; 0 (default): variants alternate, nothing more")
    p.add_argument("--heads", type=POSITIVE_INT)
    p.add_argument("--kv-heads", type=POSITIVE_INT)
    p.add_argument("--head-dim", type=POSITIVE_INT)
    p.add_argument("--prefill-len", type=NON_NEGATIVE_INT, help="new tokens per request in prefill; 0 = whole ctx")
    p.add_argument("--block-size", type=POSITIVE_INT, default=16, help="paged block size in tokens")
    p.add_argument("--vmem-layout", nargs="+", default=["per-layer"], action=DistinctValues,
                   choices=("per-layer", "interleaved"),
                   help="vmem layouts to time, each beside paged (default: per-layer)")
    p.add_argument("--layers", type=POSITIVE_INT, default=2,
                   help="layers of the interleaved cache (its row stride; layer 0 is timed)")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), action=DistinctValues,
                   help="q and K/V dtypes, each a pass over the grid (default: float32 on the "
                        "CPU, float16 on CUDA)")
    p.add_argument("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES, default=["auto"], action=DistinctValues,
                   help="K/V storage of the caches, all timed in turns (auto: --dtype); rows of "
                        "other ones are labelled 'kv NAME'; the speed-ups between them are printed")
    p.add_argument("--baselines", nargs="*", action=DistinctValues, help="more backends to time on the same views "
                   "(default on the CPU: sdpa, except with --quick; none on CUDA)")
    p.add_argument("--repeats", type=POSITIVE_INT)
    p.add_argument("--warmup", type=NON_NEGATIVE_INT, default=1)
    p.add_argument("--threads", type=thread_count, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    p.add_argument("--out", type=result_file, help="write results as JSON here")
    args = p.parse_args(argv)
    refuse_missing_cuda(p, args.device)
    defaults = QUICK if args.quick else CUDA_DEFAULTS if args.device.startswith("cuda") else CPU_DEFAULTS
    if args.baselines is None:
        args.baselines = [] if args.quick or args.device.startswith("cuda") else ["sdpa"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ["float16" if args.device.startswith("cuda") else "float32"]
    if args.heads % args.kv_heads:      # found after the yardsticks, seconds in: the first call
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads} "
                f"(each K/V head serves a whole group of query heads)")
    if "interleaved" not in args.vmem_layout and flags_given(p, args, ["layers"]):
        p.error("--layers sets the interleaved cache's row stride and --vmem-layout "
                f"{' '.join(args.vmem_layout)} times no interleaved cache: add interleaved "
                "to --vmem-layout or drop --layers")
    return args


def grid(args) -> list[tuple[int, int]]:
    """The (batch, ctx) pairs of a run: ``--configs``, else every batch with every context."""
    return args.configs or [(b, c) for b in args.batches for c in args.contexts]


def num_configs(args) -> int:
    """Progress units of a run: one per (batch, ctx, phase)."""
    return len(grid(args)) * len(args.phases) * len(args.dtype)


def measure(args, progress=None) -> dict:
    """The yardsticks, then every configuration of ``args``; print the header and one line per
    cache and backend; return JSON."""
    device, dtypes = torch.device(args.device), [DTYPES[d] for d in args.dtype]
    for dtype, (batch, ctx) in ((d, bc) for d in dtypes for bc in grid(args)):   # before any
        check_fits_device(f"attention b{batch} ctx{ctx} ({dtype}): its K/V and caches",
                          bytes_needed(batch, ctx, args, device, dtype), device,
                          remedy="lower BATCHxCTX (--configs, --batches, --contexts)")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    limits = yardstick.measure(device, torch.float16 if device.type == "cuda" else torch.float32,
                               **(QUICK_YARDSTICK if args.quick and device.type == "cpu" else {}))
    backends = {kind: fastest_backend(kind, device.type, block_size=args.block_size, dtype=dtypes[0])
                for kind in ("vmem", "paged")}
    from vmemkv.benchmarks.suite import versions
    env = environment(args.seed, args.warmup, args.repeats, device=str(device), **versions(device.type),
                      dtype=",".join(args.dtype),
                      threads=torch.get_num_threads(), heads=f"{args.heads}/{args.kv_heads}x{args.head_dim}",
                      block_size=args.block_size, vmem_layout=",".join(args.vmem_layout),
                      layers=args.layers, flush_mib=args.flush_mib,
                      backends=",".join(f"{k}:{v}" for k, v in backends.items()),
                      read_gb_per_s=round(limits["read_gb_per_s"], 2),
                      copy_gb_per_s=round(limits["copy_gb_per_s"], 2),
                      matmul_gflop_per_s=round(limits["matmul_gflop_per_s"], 1),
                      fma_peak_gflop_per_s=round(limits.get("fma_peak_gflop_per_s") or 0, 1))
    print_environment(env)
    print(yardstick.describe(limits))
    print(HEADER)
    rows, baselines = [], []
    for dtype, (batch, ctx) in ((d, bc) for d in dtypes for bc in grid(args)):
        caches = sum((build_caches(batch, ctx, args, device, dtype, gen, kv)
                      for kv in args.kv_cache_dtype), ())
        names = labels(args) * len(args.kv_cache_dtype)
        for phase in args.phases:
            qlen = 1 if phase == "decode" else min(ctx, args.prefill_len or ctx)
            q = torch.randn(batch * qlen, args.heads, args.head_dim, generator=gen,
                            device=device).to(dtype)
            now = run_configs(caches, names, phase, batch, ctx, qlen, q, args, device, limits)
            for row in now:
                row["unreliable"] = over_yardstick(row)
                (baselines if row["baseline"] else rows).append(row)
                print(fmt(row), flush=True)
            print(ratio_line(now), flush=True)
            if progress:
                progress(f"attention {phase} b{batch} ctx{ctx}")
        for cache in caches:
            cache.close()
    ratios, vs_baselines = speedups(rows), baseline_ratios(rows, baselines)
    target, met = target_check(ratios, device), goals(rows, vs_baselines)
    print_goals(target, met, limits.get("read_gb_per_s"))
    by_kv = kv_ratios(rows)
    for r in by_kv:
        print(f"# {r['cache']} {r['phase']} b{r['batch']} ctx{r['ctx']} {r['dtype']}: "
              + ", ".join(f"kv {k} {v:.2f}x" for k, v in r["speedup_over"].items()))
    warnings = run_warnings(rows + baselines, max(env.get("load_1min", 0.0), os.getloadavg()[0]))
    for warning in warnings:
        print(f"# WARNING: {warning}")
    return {"benchmark": "attention", "environment": env, "yardsticks": limits, "warnings": warnings,
            "copy_gb_per_s": limits["copy_gb_per_s"], "results": rows, "speedups": ratios,
            "target": target, "goals": met, "baselines": baselines,
            "baseline_ratios": vs_baselines, "kv_cache_dtype_speedups": by_kv}


def kv_ratios(rows: list[dict]) -> list[dict]:
    """Per (cache, phase, batch, ctx, q dtype) timed in several kv_cache_dtypes: each one's
    speed-up over each other (``speedup_over["fp8_e4m3/auto"]``: auto's ms / fp8's)."""
    groups: dict = {}
    for r in rows:
        key = (r["cache"], r["phase"], r["batch"], r["ctx"], r["dtype"])
        groups.setdefault(key, {})[r.get("kv_cache_dtype", "auto")] = r["ms"]
    out = []
    for (cache, phase, batch, ctx, dtype), ms in groups.items():
        if len(ms) > 1:
            pairs = {f"{a}/{b}": ms[b] / ms[a] for a in ms for b in ms if a != b}
            out.append({"cache": cache, "phase": phase, "batch": batch, "ctx": ctx,
                        "dtype": dtype, "speedup_over": pairs})
    return out


def run(quick: bool = False, out: str | None = None, device: str | None = None,
        progress=None, argv: list[str] | None = None) -> dict:
    """The suite's entry point: same as the CLI with ``--quick``/``--device``/``--out``."""
    argv = list(argv or []) + (["--quick"] if quick else []) + (["--device", device] if device else [])
    args = parse_args(argv)
    payload = measure(args, progress)
    if out:
        write_json(str(out), payload)
    return payload


def main(argv=None) -> int:
    """Ctrl-C: exit 130 and one line (``exit_status``); --out is then written whole or not at all."""
    return exit_status("attention", lambda: measure_and_write(parse_args(argv)))


def measure_and_write(args) -> int:
    try:
        payload = measure(args)
    except CacheTooLargeError as error:
        print(f"attention: error: CacheTooLargeError: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{args.out} not written" if args.out else "") from None
    if args.out:   # write_json is atomic: a Ctrl-C inside it leaves no file, or the old one
        write_json(str(args.out), payload)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
