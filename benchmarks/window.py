"""KV bytes held per sequence by a sliding-window model at 4x and 16x the window, full
allocation against window-aware allocation, measured on the real caches of this machine.

    python -m vmemkv.benchmarks.window [--window 512] [--out bench_out/window.json]

One sequence decodes from a one-token prompt to 16x the window through ``make_kv`` (the real
manager and the real cache: vmem pages mapped and unmapped in a host VirtualRange, paged blocks
in a preallocated pool), the step loop the scheduler runs: ``release_behind_window`` at the
step's earliest query, ``append``, execute the plan. Held bytes are read from the cache:
mapped pages x page bytes (vmem, from ``range.mapped_pages()``), blocks in the table x block bytes (paged). "full" is the same
model without windows (``CacheConfig.layer_windows=()``).

The model is Mistral-shaped but scaled to the host: 4 layers, 8 KV heads x 128, fp16 (16 KiB
per token), every layer windowed; and a hybrid of 5 windowed layers to 1 full (Gemma 3's
pattern). On vmem per-layer the hybrid's page groups are a full and a window kind's extents,
and the window kind's are given back behind the window; paged keeps one block table per
block group (here 6 groups of one layer) and its windowed groups give back their blocks; an
interleaved page serves every layer at once, so there the hybrid keeps every unit.
``--straddling`` adds the hybrid with 3 KV heads (768 B a layer-token: a 64 KiB page holds no
whole token, a member spans 3 pages) on vmem per-layer: each kind backed by its bytes, the
window kind given back.
"""
from __future__ import annotations


import torch

from vmemkv.benchmarks.common import environment, exit_status, format_table, print_environment, write_json
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import bounded, result_file

KiB = 2**10
MAX_WINDOW_TOKENS = 8192
LAYOUTS = (("vmem", "per-layer"), ("vmem", "interleaved"), ("paged", "per-layer"))
MODELS = {"uniform (4 of 4 windowed)": (4, (True,) * 4),
          "hybrid (5 of 6 windowed)": (6, (True,) * 5 + (False,))}
STRADDLING = {"hybrid, 3 KV heads (no whole token a page)": (6, (True,) * 5 + (False,))}


def _config(layers: int, windowed, window: int, aware: bool, max_context: int, kv_heads=8):
    from vmemkv.runtime.config import CacheConfig
    windows = tuple(window if w else None for w in windowed) if aware else ()
    return CacheConfig(layers, kv_heads, 128, torch.float16, "cpu", max_batch=1,
                       max_context=max_context, layer_windows=windows)


def held_bytes(kv) -> int:
    """KV bytes the cache holds for its sequences right now (what the plans mapped / placed)."""
    if kv.cache.kind == "vmem":
        return len(kv.cache.range.mapped_pages()) * kv.cache.page_bytes
    c, groups = kv.cache.config, kv.cache.groups     # a block holds one group's layers
    blocks = sum(b is not None for table in kv.cache.block_tables(0) for b in table)
    return blocks * kv.cache.block_size * c.bytes_per_token * len(groups[0]) // c.num_layers


def run_one(kind: str, layout: str, layers: int, windowed, window: int, aware: bool,
            page_bytes: int = 64 * KiB, block_size: int = 16, kv_heads: int = 8) -> dict:
    """Decode one sequence to 16x ``window``; held bytes at 4x and 16x."""
    from vmemkv.runtime.kv import make_kv
    marks, ctx = (4 * window, 16 * window), 16 * window
    config = _config(layers, windowed, window, aware, ctx, kv_heads)
    out = {}
    # a paged cache has blocks, no pages: it refuses the vmem-only options (make_kv)
    vmem_only = dict(layout=layout, page_bytes=page_bytes, grow_pages=True) \
        if kind == "vmem" else {}
    with make_kv(config, kind, block_size=block_size, **vmem_only) as kv:
        m = kv.manager
        m.allocate(0, 1)
        kv.execute(m.take_ops())
        for n in range(1, ctx):      # token n-1 computed: the next query is at position n
            m.release_behind_window(0, n)
            m.append(0, 1)
            kv.execute(m.take_ops())
            kv.sync_tables([0])      # the table edits a plan carries (paged: the block table)
            if n + 1 in marks:
                out[n + 1] = held_bytes(kv)
        kv.check_integrity()
    return out


def measure(window: int = 512, page_bytes: int = 64 * KiB, block_size: int = 16,
            straddling: bool = False) -> list:
    rows = []
    cases = [(m, shape, kl, 8) for m, shape in MODELS.items() for kl in LAYOUTS]
    if straddling:
        cases += [(m, shape, ("vmem", "per-layer"), 3) for m, shape in STRADDLING.items()]
    for model, (layers, windowed), (kind, layout), heads in cases:
        full = run_one(kind, layout, layers, windowed, window, False, page_bytes, block_size,
                       heads)
        aware = run_one(kind, layout, layers, windowed, window, True, page_bytes, block_size,
                        heads)
        for mult in (4, 16):
            ctx = mult * window
            rows.append({"model": model, "cache": kind if kind == "paged" else f"vmem {layout}",
                         "context": f"{mult}x window ({ctx})",
                         "full_MiB": round(full[ctx] / 2**20, 2),
                         "window_aware_MiB": round(aware[ctx] / 2**20, 2),
                         "saved": f"{1 - aware[ctx] / full[ctx]:.0%}"})
    return rows


def main(argv=None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    # 16x the window at 16 KiB a token is the cache: 8192 -> 2 GiB (10**5 failed as a
    # CacheTooLargeError naming max_context, a field the user never gave)
    parser.add_argument("--window", type=bounded(int, 1, MAX_WINDOW_TOKENS), default=512,
                        help=f"sliding window in tokens (1 to {MAX_WINDOW_TOKENS})")
    parser.add_argument("--out", default=None, type=result_file, help="JSON output path")
    parser.add_argument("--straddling", action="store_true",
                        help="add the hybrid on pages that hold no whole token (vmem per-layer)")
    args = parser.parse_args(argv)
    env = environment(seed=0, warmup=0, repeats=1, window=args.window, page_bytes=64 * KiB,
                      block_size=16)
    print_environment(env)
    rows = measure(args.window, straddling=args.straddling)
    print(format_table(rows, ["model", "cache", "context", "full_MiB", "window_aware_MiB", "saved"]))
    write_json(args.out, {"environment": env, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(exit_status("window", main))
