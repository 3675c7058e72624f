"""Attention time on the real vmem and paged caches, each with the fastest backend for the device.

    python benchmarks/attention.py                 # CPU: scaled-down defaults, < 3 min
    python benchmarks/attention.py --quick         # smoke run, seconds
    python benchmarks/attention.py --device cuda   # fp16, full prefill, Llama-3-8B heads
    python benchmarks/attention.py --out results/attention.json
    python benchmarks/attention.py --configs 1x2048 1x8192 8x2048 32x4096 --phases decode

One line per configuration: cache | phase | backend | batch | ctx | q | ms | GB/s | % copy.
``--baselines`` (CPU default: ``sdpa``, the per-request path) times more backends on the same
views, alternating with the fastest; they go to ``baselines`` in the JSON, with their time over
the fastest backend's in ``baseline_ratios``. A baseline may carry backend options,
``name:key=value,...`` (integers or ``None``): ``cpu-varlen:work_units=1`` is the kernel with its
key ranges never split, timed beside the default that splits them at batch 1.
GB/s counts the K/V bytes attention must read (every live token's K and V once); a paged
gather shows up as lower GB/s for the same bytes. "% copy" divides that by the bandwidth of a
large same-device tensor copy, counted as bytes read + bytes written per second.

Storage: the real caches (``runtime.kv.make_kv``), one layer each. Both are filled the way
a running batch fills them: every request grows by one block's worth of tokens in turn, so the
paged block tables interleave requests (a real pool's order), and the vmem manager maps pages
under each request's slot. The same K/V go into both; the two outputs are checked against each
other before anything is timed. Each timed call is ``backend.forward(q, cache.layer_view(0))``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from vmemkv.benchmarks.common import environment, print_environment
from vmemkv.scheduler.result_files import write_json
from vmemkv.runtime.attention import fastest_backend, get_backend
from vmemkv.runtime.kv import make_kv, vmem_geometry
from vmemkv.runtime.config import CacheConfig

# CPU: 8k contexts at batch 32 alone would take minutes on a small host; 4k is the top here.
CPU_DEFAULTS = dict(batches=[1, 8, 32], contexts=[512, 2048, 4096], heads=32, kv_heads=8,
                    head_dim=128, prefill_len=16, repeats=5)
QUICK = dict(batches=[1, 8], contexts=[512, 2048], heads=32, kv_heads=8, head_dim=128,
             prefill_len=16, repeats=3)
CUDA_DEFAULTS = dict(batches=[1, 8, 32], contexts=[512, 2048, 8192], heads=32, kv_heads=8,
                     head_dim=128, prefill_len=0, repeats=20)   # prefill_len 0: whole prompt
PHASES = ("decode", "prefill")
TARGET = dict(phase="decode", batch=8, ctx=2048, speedup=1.5)  # issue 4, CPU fp32


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


def median_times(fns, device, warmup: int, repeats: int) -> list[float]:
    """Median seconds of each fn; the fns alternate so a noisy neighbour hits them alike."""
    return [statistics.median(s) for s in sample_times(fns, device, warmup, repeats)]


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
    """A call that writes ``mib`` MiB (untimed: K/V then come from memory, whatever the order of
    the variants), or None for 0. Without it a variant timed right after another on the same
    cache finds the K/V the other left in the last-level cache (a 15 MB cache in a 32 MiB L3)."""
    if not mib:
        return None
    junk = torch.zeros((mib << 20) // 4, device=device)
    return lambda: junk.add_(1.0)


def copy_bandwidth(device, dtype, nbytes: int) -> float:
    """Bytes/s of a large same-device copy, counting the read and the write."""
    src = torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
    dst = torch.empty_like(src)
    (t,) = median_times([lambda: dst.copy_(src)], device, warmup=2, repeats=5)
    return 2 * nbytes / t


def cache_config(batch: int, ctx: int, args, device, dtype) -> CacheConfig:
    """One layer, ``batch`` slots; max_context is ctx rounded up to whole vmem pages."""
    probe = CacheConfig(1, args.kv_heads, args.head_dim, dtype, str(device), batch, ctx)
    max_ctx = vmem_geometry(probe, "per-layer").round_up_tokens(ctx)
    return CacheConfig(1, args.kv_heads, args.head_dim, dtype, str(device), batch, max_ctx)


def fill(kv, batch: int, ctx: int, chunk: int, k: torch.Tensor, v: torch.Tensor):
    """Grow requests 0..batch-1 to ``ctx`` tokens, ``chunk`` at a time in turn, then write K/V.

    k, v: (batch * ctx, kv_heads, head_dim), request-major (request i owns rows i*ctx ...).
    """
    manager, cache = kv.manager, kv.cache
    for seq in range(batch):
        manager.allocate(seq, min(chunk, ctx))
    for start in range(chunk, ctx, chunk):
        for seq in range(batch):
            manager.append(seq, min(chunk, ctx - start))
    cache.execute(manager.take_ops())
    kv.sync_tables(range(batch))
    cache.begin_step([(seq, 0, ctx) for seq in range(batch)])
    cache.write(0, k, v)
    return kv


def build_caches(batch, ctx, args, device, dtype, gen):
    """(vmem cache, paged cache), both holding the same random K/V for ``batch`` x ``ctx`` tokens."""
    config = cache_config(batch, ctx, args, device, dtype)
    shape = (batch * ctx, args.kv_heads, args.head_dim)
    k = torch.randn(shape, generator=gen, dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen, dtype=dtype, device=device)
    pairs = (make_kv(config, "vmem", layout=args.vmem_layout),
             make_kv(config, "paged", block_size=args.block_size))
    return tuple(fill(kv, batch, ctx, args.block_size, k, v) for kv in pairs)


def run_configs(caches, phase, batch, ctx, qlen, q, args, device, copy_bw) -> list[dict]:
    """Check every output against the first (vmem, fastest backend), then time them all,
    alternating: per cache its fastest backend, then each baseline. Rows in that order, each
    with ``baseline`` saying which it is."""
    calls, labels, outs = [], [], []
    for cache in caches:
        cache.begin_step([(seq, ctx - qlen, qlen) for seq in range(batch)])
        view = cache.layer_view(0)
        fastest = fastest_backend(cache.kind, device.type, block_size=args.block_size, dtype=q.dtype)
        for name in [fastest] + [b for b in args.baselines if b != fastest]:
            backend = backend_of(name)
            outs.append(backend.forward(q, view))   # first call: lazy imports, one-time warnings
            labels.append((cache.kind, name, name != fastest))
            calls.append(lambda b=backend, v=view: b.forward(q, v))
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    for out in outs[1:]:
        torch.testing.assert_close(outs[0].float(), out.float(), atol=tol, rtol=tol)
    samples = sample_times(calls, device, args.warmup, args.repeats,
                           cache_flusher(device, args.flush_mib))
    kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * q.element_size()
    rows = []
    for (kind, name, baseline), times in zip(labels, samples):
        t = statistics.median(times)
        rows.append({"cache": kind, "phase": phase, "backend": name, "batch": batch,
                     "ctx": ctx, "query_len": qlen, "ms": t * 1e3, "ms_min": min(times) * 1e3,
                     "ms_max": max(times) * 1e3, "kv_gb_per_s": kv_bytes / t / 1e9,
                     "pct_copy": 100 * kv_bytes / t / copy_bw, "checked": True,
                     "baseline": baseline})
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
    fastest = {(r["cache"], r["phase"], r["batch"], r["ctx"]): r for r in rows}
    out = []
    for b in baselines:
        r = fastest[(b["cache"], b["phase"], b["batch"], b["ctx"])]
        out.append({"cache": b["cache"], "phase": b["phase"], "batch": b["batch"], "ctx": b["ctx"],
                    "baseline": b["backend"], "backend": r["backend"],
                    "baseline_over_backend": b["ms"] / r["ms"]})
    return out


def fmt(r) -> str:
    return (f"{r['cache']:<6}| {r['phase']:<8}| {r['backend']:<10}| {r['batch']:>5} | {r['ctx']:>6} | "
            f"{r['query_len']:>5} | {r['ms']:>9.3f} | {r['kv_gb_per_s']:>7.2f} | {r['pct_copy']:>6.1f}%")


def speedups(rows: list[dict]) -> list[dict]:
    """paged ms / vmem ms per (phase, batch, ctx): > 1 means vmem is faster."""
    by_key = {(r["phase"], r["batch"], r["ctx"], r["cache"]): r["ms"] for r in rows}
    return [{"phase": p, "batch": b, "ctx": c, "paged_over_vmem": by_key[(p, b, c, "paged")] / ms}
            for (p, b, c, kind), ms in by_key.items()
            if kind == "vmem" and (p, b, c, "paged") in by_key]


def target_check(ratios: list[dict], device, dtype) -> dict:
    """Issue 4's CPU target: decode, batch 8, ctx 2k, fp32 -- vmem >= 1.5x paged, never slower."""
    hit = [r for r in ratios if (r["phase"], r["batch"], r["ctx"]) ==
           (TARGET["phase"], TARGET["batch"], TARGET["ctx"])]
    worst = min((r["paged_over_vmem"] for r in ratios), default=None)
    out = {"applies": device.type == "cpu" and dtype == torch.float32,
           "decode_b8_ctx2048_speedup": hit[0]["paged_over_vmem"] if hit else None,
           "required_speedup": TARGET["speedup"], "min_speedup_anywhere": worst}
    out["met"] = bool(hit) and hit[0]["paged_over_vmem"] >= TARGET["speedup"]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="smallest useful run")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--configs", type=batch_by_ctx, nargs="+", metavar="BATCHxCTX",
                   help="(batch, context) pairs, e.g. 1x8192 8x2048, instead of the grid "
                        "--batches x --contexts")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    p.add_argument("--flush-mib", type=int, default=0,
                   help="write this many MiB between timed calls (untimed) so every call "
                        "reads K/V from memory; 0 (default): variants alternate, nothing more")
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--prefill-len", type=int, help="new tokens per request in prefill; 0 = whole ctx")
    p.add_argument("--block-size", type=int, default=16, help="paged block size in tokens")
    p.add_argument("--vmem-layout", default="per-layer", choices=("per-layer", "interleaved"))
    p.add_argument("--baselines", nargs="*", help="more backends to time on the same views "
                   "(default on the CPU: sdpa, except with --quick; none on CUDA)")
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write results as JSON here")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else CUDA_DEFAULTS if args.device.startswith("cuda") else CPU_DEFAULTS
    if args.baselines is None:
        args.baselines = [] if args.quick or args.device.startswith("cuda") else ["sdpa"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def batch_by_ctx(text: str) -> tuple[int, int]:
    """``8x2048`` -> (8, 2048)."""
    batch, sep, ctx = text.partition("x")
    if not sep or not batch.isdigit() or not ctx.isdigit():
        raise argparse.ArgumentTypeError(f"expected BATCHxCTX such as 8x2048; got {text!r}")
    return int(batch), int(ctx)


def grid(args) -> list[tuple[int, int]]:
    """The (batch, ctx) pairs of a run: ``--configs``, else every batch with every context."""
    return args.configs or [(b, c) for b in args.batches for c in args.contexts]


def num_configs(args) -> int:
    """Progress units of a run: one per (batch, ctx, phase)."""
    return len(grid(args)) * len(args.phases)


def measure(args, progress=None) -> dict:
    """Run every configuration of ``args``; print the header and one line per cache kind; return JSON."""
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    copy_bw = copy_bandwidth(device, dtype, 1 << (30 if device.type == "cuda" else 28))
    backends = {kind: fastest_backend(kind, device.type, block_size=args.block_size, dtype=dtype)
                for kind in ("vmem", "paged")}
    from vmemkv.benchmarks.suite import versions
    env = environment(args.seed, args.warmup, args.repeats, device=str(device), **versions(device.type),
                      dtype=str(dtype),
                      threads=torch.get_num_threads(), heads=f"{args.heads}/{args.kv_heads}x{args.head_dim}",
                      block_size=args.block_size, vmem_layout=args.vmem_layout, flush_mib=args.flush_mib,
                      backends=",".join(f"{k}:{v}" for k, v in backends.items()),
                      copy_gb_per_s=round(copy_bw / 1e9, 2))
    print_environment(env)
    print("cache | phase   | backend   | batch |    ctx |     q |        ms |    GB/s | % copy")
    rows, baselines = [], []
    for batch, ctx in grid(args):
        caches = build_caches(batch, ctx, args, device, dtype, gen)
        for phase in args.phases:
            qlen = 1 if phase == "decode" else min(ctx, args.prefill_len or ctx)
            q = torch.randn(batch * qlen, args.heads, args.head_dim, dtype=dtype, device=device,
                            generator=gen)
            now = run_configs(caches, phase, batch, ctx, qlen, q, args, device, copy_bw)
            for row in now:
                (baselines if row["baseline"] else rows).append(row)
                print(fmt(row), flush=True)
            print(f"{'':6}  paged/vmem time ratio {rows[-1]['ms'] / rows[-2]['ms']:.2f}x"
                  + "".join(f"; {r['backend']}/{rows[-2 + (r['cache'] == 'paged')]['backend']}"
                            f" {r['cache']} {r['ms'] / rows[-2 + (r['cache'] == 'paged')]['ms']:.2f}x"
                            for r in now if r["baseline"]), flush=True)
            if progress:
                progress(f"attention {phase} b{batch} ctx{ctx}")
        for cache in caches:
            cache.close()
    ratios = speedups(rows)
    target = target_check(ratios, device, dtype)
    if target["applies"] and target["decode_b8_ctx2048_speedup"] is not None:
        print(f"# target: decode b8 ctx2k vmem {target['decode_b8_ctx2048_speedup']:.2f}x paged "
              f"(need >= {TARGET['speedup']}): {'met' if target['met'] else 'NOT met'}; "
              f"slowest ratio anywhere {target['min_speedup_anywhere']:.2f}x")
    return {"benchmark": "attention", "environment": env, "copy_gb_per_s": copy_bw / 1e9,
            "results": rows, "speedups": ratios, "target": target, "baselines": baselines,
            "baseline_ratios": baseline_ratios(rows, baselines)}


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
    args = parse_args(argv)
    payload = measure(args)
    if args.out:
        write_json(str(args.out), payload)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
