"""Attention time on the vmem and paged layouts, each with the fastest backend for the device.

    python benchmarks/attention.py                 # CPU: scaled-down defaults, < 3 min
    python benchmarks/attention.py --quick         # smoke run, seconds
    python benchmarks/attention.py --device cuda   # fp16, full prefill, Llama-3-8B heads
    python benchmarks/attention.py --out results/attention.json

One line per configuration: layout | phase | backend | batch | ctx | q | ms | GB/s | % copy.
GB/s counts the K/V bytes attention must read (every live token's K and V once); a paged
gather shows up as lower GB/s for the same bytes. "% copy" divides that by the bandwidth of a
large same-device tensor copy, counted as bytes read + bytes written per second.

Storage: for now the vmem tensors are plain ``torch.empty`` and the paged block tables a random
permutation of the pool; the real caches will replace both.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime.attention import PagedLayerView, VMemLayerView, fastest_backend, get_backend  # noqa: E402

# CPU: 8k contexts at batch 32 alone would take minutes on a small host; 4k is the top here.
CPU_DEFAULTS = dict(batches=[1, 8, 32], contexts=[512, 2048, 4096], heads=32, kv_heads=8,
                    head_dim=128, prefill_len=16, repeats=5)
QUICK = dict(batches=[1, 8], contexts=[512, 2048], heads=32, kv_heads=8, head_dim=128,
             prefill_len=16, repeats=3)
CUDA_DEFAULTS = dict(batches=[1, 8, 32], contexts=[512, 2048, 8192], heads=32, kv_heads=8,
                     head_dim=128, prefill_len=0, repeats=20)   # prefill_len 0: whole prompt


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


def median_time(fn, device, warmup: int, repeats: int) -> float:
    return median_times([fn], device, warmup, repeats)[0]


def median_times(fns, device, warmup: int, repeats: int) -> list[float]:
    """Median seconds of each fn; the fns alternate so a noisy neighbour hits them alike."""
    run = timer(device)
    for _ in range(warmup):
        for fn in fns:
            run(fn)
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            out.append(run(fn))
    return [statistics.median(s) for s in samples]


def copy_bandwidth(device, dtype, nbytes: int) -> float:
    """Bytes/s of a large same-device copy, counting the read and the write."""
    src = torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device, warmup=2, repeats=5)
    return 2 * nbytes / t


def build_views(batch, ctx, qlen, args, device, dtype, gen):
    """vmem: [batch, ctx, Hkv, D] with shuffled slots; paged: shuffled pool + block tables."""
    hkv, d, bs = args.kv_heads, args.head_dim, args.block_size
    k = torch.empty(batch, ctx, hkv, d, dtype=dtype, device=device).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    ctx_lens = torch.full((batch,), ctx, device=device)
    q_lens = torch.full((batch,), qlen, device=device)
    slots = torch.randperm(batch, generator=gen, device=device)
    vmem = VMemLayerView(k, v, slots, ctx_lens, q_lens)
    nb = math.ceil(ctx / bs)
    pk = torch.empty(batch * nb, bs, hkv, d, dtype=dtype, device=device).normal_(generator=gen)
    pv = torch.empty_like(pk).normal_(generator=gen)
    table = torch.randperm(batch * nb, generator=gen, device=device).view(batch, nb).to(torch.int32)
    paged = PagedLayerView(pk, pv, table, ctx_lens, q_lens)
    return vmem, paged


def run_configs(views, phase, batch, ctx, qlen, q, args, device, copy_bw) -> list[dict]:
    """Time each (layout, view) with the fastest backend for it, alternating the layouts."""
    names = [fastest_backend(layout, device.type, block_size=args.block_size) for layout, _ in views]
    calls = []
    for name, (_, view) in zip(names, views):
        backend = get_backend(name)
        backend.forward(q, view)   # first call: lazy imports, one-time warnings
        calls.append(lambda b=backend, v=view: b.forward(q, v))
    times = median_times(calls, device, args.warmup, args.repeats)
    kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * q.element_size()
    return [{"layout": layout, "phase": phase, "backend": name, "batch": batch, "ctx": ctx,
             "query_len": qlen, "ms": t * 1e3, "kv_gb_per_s": kv_bytes / t / 1e9,
             "pct_copy": 100 * kv_bytes / t / copy_bw}
            for (layout, _), name, t in zip(views, names, times)]


def fmt(r) -> str:
    return (f"{r['layout']:<6}| {r['phase']:<8}| {r['backend']:<10}| {r['batch']:>5} | {r['ctx']:>6} | "
            f"{r['query_len']:>5} | {r['ms']:>9.3f} | {r['kv_gb_per_s']:>7.2f} | {r['pct_copy']:>6.1f}%")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="smallest useful run")
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--prefill-len", type=int, help="new tokens per request in prefill; 0 = whole ctx")
    p.add_argument("--block-size", type=int, default=16, help="paged block size in tokens")
    p.add_argument("--repeats", type=int)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write results as JSON here")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else CUDA_DEFAULTS if args.device.startswith("cuda") else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    copy_bw = copy_bandwidth(device, dtype, 1 << (30 if device.type == "cuda" else 28))
    print(f"# device {device} ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"{dtype}, threads {torch.get_num_threads()}, heads {args.heads}/{args.kv_heads}x{args.head_dim}, "
          f"block {args.block_size}; copy bandwidth {copy_bw / 1e9:.1f} GB/s (read+write)")
    print("layout| phase   | backend   | batch |    ctx |     q |        ms |    GB/s | % copy")
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            for phase in ("decode", "prefill"):
                qlen = 1 if phase == "decode" else min(ctx, args.prefill_len or ctx)
                vmem, paged = build_views(batch, ctx, qlen, args, device, dtype, gen)
                q = torch.randn(batch * qlen, args.heads, args.head_dim, dtype=dtype, device=device,
                                generator=gen)
                for row in run_configs([("vmem", vmem), ("paged", paged)], phase, batch, ctx, qlen,
                                       q, args, device, copy_bw):
                    rows.append(row)
                    print(fmt(row), flush=True)
                print(f"{'':6}  paged/vmem time ratio {rows[-1]['ms'] / rows[-2]['ms']:.2f}x", flush=True)
                del vmem, paged, q
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": str(device), "torch": torch.__version__, "dtype": str(dtype),
                "copy_gb_per_s": copy_bw / 1e9, "args": {k: str(v) for k, v in vars(args).items()}}
        args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
