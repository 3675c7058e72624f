"""VMemKVCache on pages that do not hold whole tokens (issue 17 item 1), on the host driver
forced to such a page size: a token straddles two pages of a member, and each page-group
member spans the fewest pages holding whole tokens. The random mixes of prefill, decode, fork,
shared prefixes, preemption and swap of test_cache_correctness keep every sequence's contents
equal to the shadow copy and attention equal to dense attention."""
import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.scheduler.geometry import PageGeometry

from .harness import ShadowRun

KiB = 2**10

# (layers, kv_heads, head_dim, layout, page_bytes): bytes per token per page never divide the page
STRADDLING = [
    pytest.param((2, 2, 80, "per-layer", 4 * KiB), id="head_dim-80"),         # 640 B: 5 pages a member
    pytest.param((2, 2, 96, "per-layer", 4 * KiB), id="head_dim-96"),         # 768 B: 3 pages
    pytest.param((2, 3, 16, "per-layer", 4 * KiB), id="3-kv-heads"),          # 192 B: 3 pages
    pytest.param((3, 2, 16, "interleaved", 4 * KiB), id="interleaved-3-layers"),  # 384 B: 3 pages
    pytest.param((2, 3, 16, "per-layer", 64 * KiB), id="3-kv-heads-64KiB"),   # 192 B: 3 pages
]


def config(layers, kv_heads, head_dim, layout, page_bytes):
    probe = CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        dtype=torch.float32, max_batch=4, max_context=2)
    tpp = PageGeometry.of(probe, page_bytes, layout).tokens_per_page
    return CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                       dtype=torch.float32, max_batch=4, max_context=max(64, 2 * tpp))


@pytest.mark.parametrize("shape", STRADDLING)
@pytest.mark.parametrize("seed", [0, 1])
def test_straddling_pages_keep_contents_and_attention_exact(shape, seed):
    *dims, layout, page_bytes = shape
    cfg = config(*dims, layout, page_bytes)
    run = ShadowRun(cfg, "vmem", seed, backends=("sdpa", "reference"),
                    cache_bytes=int(2.5 * cfg.max_context * cfg.bytes_per_token),
                    swap_bytes=cfg.max_context * cfg.bytes_per_token * 2,
                    num_heads=2 * dims[1], layout=layout, page_bytes=page_bytes)
    assert not run.cache.geometry.exact and run.cache.geometry.pages_per_member > 1
    events = run.run(60)
    assert run.checked_attention > 0 and events["decode"] > 50
    run.cache.check_integrity()
    run.cache.close()


@pytest.mark.parametrize("shape", STRADDLING[:1] + STRADDLING[3:4])
def test_straddling_pages_see_forks_prefix_hits_and_swaps(shape):
    *dims, layout, page_bytes = shape
    cfg = config(*dims, layout, page_bytes)
    totals = {}
    for seed in range(4):
        run = ShadowRun(cfg, "vmem", 100 + seed, backends=(),
                        cache_bytes=int(2.5 * cfg.max_context * cfg.bytes_per_token),
                        swap_bytes=cfg.max_context * cfg.bytes_per_token * 2,
                        layout=layout, page_bytes=page_bytes)
        for key, value in run.run(80).items():
            totals[key] = totals.get(key, 0) + value
        run.cache.close()
    for key in ("fork", "prefix_hit_tokens", "swap_in", "free"):
        assert totals[key] > 0, f"no {key} in {totals}"

