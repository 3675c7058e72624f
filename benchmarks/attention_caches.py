"""The real caches ``benchmarks/attention.py`` times: vmem (per-layer and interleaved) and paged,
filled with the same K/V the way a running batch fills them.

Every cache is built with ``runtime.kv.make_kv`` and grown one block's worth of tokens per
request in turn, so the paged block tables interleave requests (a real pool's order) and the
vmem manager maps pages under each request's slot. The interleaved cache holds ``layers``
layers (default 2), all written, so the layer timed (layer 0) is the strided view
``k_all[:, :, 0]`` whose token rows lie ``layers x kv_heads x head_dim`` elements apart; the
per-layer and paged caches hold one layer.
"""
from __future__ import annotations

import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.kv import make_kv, vmem_geometry

LABELS = {"per-layer": "vmem", "interleaved": "vmem interleaved"}   # a row's "cache"


def cache_config(batch: int, ctx: int, args, device, dtype, layers: int = 1,
                 layout: str = "per-layer", kv_cache_dtype: str = "auto") -> CacheConfig:
    """``layers`` layers, ``batch`` slots; max_context is ctx rounded up to whole vmem pages;
    K/V stored as ``kv_cache_dtype`` (8-bit: scales fixed by the fill's write)."""
    probe = CacheConfig(layers, args.kv_heads, args.head_dim, dtype, str(device), batch, ctx,
                        kv_cache_dtype=kv_cache_dtype)
    max_ctx = vmem_geometry(probe, layout).round_up_tokens(ctx)
    return CacheConfig(layers, args.kv_heads, args.head_dim, dtype, str(device), batch, max_ctx,
                       kv_cache_dtype=kv_cache_dtype)


def fill(kv, batch: int, ctx: int, chunk: int, k: torch.Tensor, v: torch.Tensor):
    """Grow requests 0..batch-1 to ``ctx`` tokens, ``chunk`` at a time in turn, then write K/V
    into every layer.

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
    for layer in range(kv.cache.config.num_layers):
        cache.write(layer, k, v)
    return kv


def build_caches(batch, ctx, args, device, dtype, gen, kv_cache_dtype: str = "auto") -> tuple:
    """One cache per vmem layout in ``args.vmem_layout`` (in that order), then the paged cache,
    all holding the same random K/V for ``batch`` x ``ctx`` tokens, stored as
    ``kv_cache_dtype``."""
    shape = (batch * ctx, args.kv_heads, args.head_dim)
    k = torch.randn(shape, generator=gen, dtype=dtype, device=device)
    v = torch.randn(shape, generator=gen, dtype=dtype, device=device)
    kvs = []
    for layout in args.vmem_layout:
        layers = args.layers if layout == "interleaved" else 1
        config = cache_config(batch, ctx, args, device, dtype, layers, layout, kv_cache_dtype)
        kvs.append(make_kv(config, "vmem", layout=layout))
    kvs.append(make_kv(cache_config(batch, ctx, args, device, dtype,
                                    kv_cache_dtype=kv_cache_dtype), "paged",
                       block_size=args.block_size))
    return tuple(fill(kv, batch, ctx, args.block_size, k, v) for kv in kvs)


PROCESS_BYTES = 1 << 30    # torch and the yardsticks' buffers (the flush buffer: --flush-mib)


def bytes_needed(batch: int, ctx: int, args, device, dtype) -> int:
    """What a configuration holds at its peak, for every kv_cache_dtype of ``args`` at once:
    the random K/V the caches are filled from, twice (a write's encoded copy), each cache's
    pool (vmem: whole pages per slot; paged: whole blocks per request), the flush buffer
    (``--flush-mib``) and the process (``PROCESS_BYTES``). b32 ctx4k with four K/V dtypes: 7.0
    GiB charged, 6.4 GiB resident."""
    element_bytes = torch.empty(0, dtype=dtype).element_size()
    source = 2 * 2 * batch * ctx * args.kv_heads * args.head_dim * element_bytes
    pools = 0
    for kv_cache_dtype in args.kv_cache_dtype:
        for layout in args.vmem_layout:
            layers = args.layers if layout == "interleaved" else 1
            config = cache_config(batch, ctx, args, device, dtype, layers, layout, kv_cache_dtype)
            pools += batch * config.max_context * config.bytes_per_token
        config = cache_config(batch, ctx, args, device, dtype, kv_cache_dtype=kv_cache_dtype)
        blocks = -(-ctx // args.block_size)
        pools += batch * blocks * args.block_size * config.bytes_per_token
    return PROCESS_BYTES + source + pools + (args.flush_mib << 20)


def labels(args) -> list[str]:
    """Each cache's row label, in build_caches' order: ``vmem`` (per-layer), ``vmem
    interleaved``, then ``paged``."""
    return [LABELS[layout] for layout in args.vmem_layout] + ["paged"]
