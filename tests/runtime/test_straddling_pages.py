"""VMemKVCache on pages that do not hold whole tokens (issue 17 item 1), on the host driver
forced to such a page size: a token straddles two pages of a member, each page-group member
spans the fewest pages holding whole tokens, and a group is backed only by the pages its bytes
need (a byte-mapped pool: MapExtent / UnmapExtent with first_page > 0, runtime/cache/vmem_ops.py). The random mixes of prefill, decode,
fork, shared prefixes, preemption and swap of test_cache_correctness keep every sequence's
contents equal to the shadow copy and attention equal to dense attention (unbacked pages are
PROT_NONE: a read of one would fault); plans the pool cannot run are refused, changing nothing."""
import pytest
import torch

from vmemkv.runtime.cache import VMemKVCache
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheConfigError, CacheStateError
from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.plan import CopyExtent, MapExtent, SetSlot, UnmapExtent

from .harness import ShadowRun

KiB = 2**10

# (layers, kv_heads, head_dim, layout, page_bytes): bytes per token per page never divide the page
STRADDLING = [
    pytest.param((2, 2, 80, "per-layer", 4 * KiB), id="head_dim-80"),         # 640 B: 5 pages a member
    pytest.param((2, 2, 96, "per-layer", 4 * KiB), id="head_dim-96"),         # 768 B: 3 pages
    pytest.param((2, 3, 16, "per-layer", 4 * KiB), id="3-kv-heads"),          # 192 B: 3 pages
    pytest.param((3, 2, 16, "interleaved", 4 * KiB), id="interleaved-3-layers"),  # 384 B: 3 pages
    # 3 KiB: 3 pages, 64-token groups, a 60-page pool as 192 B had (1,024-token groups there:
    # 6 s of CPU a seed, dense attention over 1,500-token sequences; 0.8 s here)
    pytest.param((2, 3, 256, "per-layer", 64 * KiB), id="3-kv-heads-256-64KiB"),
]


def config(layers, kv_heads, head_dim, layout, page_bytes):
    probe = CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        dtype=torch.float32, max_batch=4, max_context=2)
    tpp = PageGeometry.of(probe, page_bytes, layout).tokens_per_page
    return CacheConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                       dtype=torch.float32, max_batch=4, max_context=max(64, 2 * tpp))


# two seeds each
CASES = [pytest.param(p.values[0], seed, id=f"{seed}-{p.id}") for p in STRADDLING for seed in (0, 1)]


@pytest.mark.parametrize("shape, seed", CASES)
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



# 3 KV heads x 16 x fp32 = 192 B a layer-token on 4 KiB pages: 3 pages a member, 64 tokens a
# group, 21 whole tokens in a member's first page; 4 members (2 layers x K, V) = 1 slice
SLICED = CacheConfig(num_layers=2, num_kv_heads=3, head_dim=16, dtype=torch.float32,
                     max_batch=2, max_context=64)
SLICED_GEOMETRY = PageGeometry.of(SLICED, 4 * KiB, "per-layer")


def _state(cache):
    return (cache.range.mapped_pages(), cache.mapped_extents(0), cache.mapped_extents(1),
            cache.mapped_pool_pages, cache.pool.free_pages)


def test_refused_extent_ops_change_nothing():
    """The replica refuses, before touching memory: a page mapped twice at one place, past a
    member's k pages, a pool page outside the pool, a kind the cache lacks, an unmap of
    nothing, a copy into less, a copy that says it moves other pages than the source has
    (CacheStateError; range, replica and pool as before)."""
    with VMemKVCache(SLICED, SLICED_GEOMETRY, 2, pool_pages=8) as cache:     # 2 slices
        cache.execute([MapExtent(0, 0, "full", (0, 1, 2, 3)), MapExtent(1, 0, "full", (4, 5, 6, 7))])
        assert len(cache.range.mapped_pages()) == 8 and cache.mapped_pool_pages == 8
        before = _state(cache)
        for plan, match in [
                ([MapExtent(0, 0, "full", (4, 5, 6, 7))], r"mapped twice at one place"),
                ([MapExtent(0, 0, "full", (4, 5, 6, 7) * 3, 1)], r"past the 3 of a member"),
                ([MapExtent(0, 0, "full", (0, 1, 2, 8), 1)], r"pool page outside 0..7"),
                ([MapExtent(0, 0, "full", (0, 1, 2), 1)], r"a page per member \(4\)"),
                ([MapExtent(0, 0, "window-8", (0, 1, 2, 3))], r"names kind 'window-8'"),
                ([MapExtent(0, 1, "full", (0, 1, 2, 3))], r"page index outside"),
                ([UnmapExtent(0, 0, "full"), UnmapExtent(0, 0, "full")],
                 r"at op 1.*an unmap of nothing"),
                ([UnmapExtent(0, 0, "full", 1)], r"an unmap of nothing"),
                ([MapExtent(0, 0, "full", (4, 5, 6, 7), 1), CopyExtent(0, 0, 1, 0, "full")],
                 r"at op 1.*mapped at least as far"),
                ([CopyExtent(0, 0, 1, 0, "full", member_pages=2)],
                 r"copies 2 member pages, but the source has 1 mapped")]:
            with pytest.raises(CacheStateError, match=match):
                cache.execute(plan)
            assert _state(cache) == before, plan
        cache.check_integrity()


def test_an_extent_grows_and_shrinks_by_member_pages_where_it_is_mapped():
    with VMemKVCache(SLICED, SLICED_GEOMETRY, 2, pool_pages=12) as cache:
        cache.execute([MapExtent(0, 0, "full", (0, 1, 2, 3)), MapExtent(1, 0, "full", (0, 1, 2, 3)),
                       MapExtent(0, 0, "full", tuple(range(4, 12)), 1),
                       MapExtent(1, 0, "full", tuple(range(4, 12)), 1)])
        assert len(cache.range.mapped_pages()) == 2 * 4 * 3 and cache.mapped_pool_pages == 12
        cache.execute([UnmapExtent(0, 0, "full", 1), UnmapExtent(1, 0, "full")])
        assert len(cache.range.mapped_pages()) == 4 and cache.mapped_pool_pages == 4
        cache.check_integrity()


def test_a_step_past_an_extents_mapped_pages_is_refused():
    with VMemKVCache(SLICED, SLICED_GEOMETRY, 2, pool_pages=8) as cache:
        cache.execute([MapExtent(0, 0, "full", (0, 1, 2, 3))])
        cache.apply_tables([SetSlot(7, 0)])
        cache.begin_step([(7, 0, 21)])                     # 21 x 192 B fit the first 4 KiB
        with pytest.raises(CacheStateError, match="mapped no memory of its .full. layers for token 21"):
            cache.begin_step([(7, 0, 22)])                 # token 21 straddles into page 1
