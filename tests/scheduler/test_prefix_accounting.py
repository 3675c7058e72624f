"""Prefix-cache accounting in the managers: ``cached_tokens`` counts the computed tokens each
cached unit holds (a vmem group cached for its published blocks: those blocks, not its page);
an allocation with ``lookup=False`` (prompt logprobs) reads no cache and counts no query but
publishes for later requests; a paged hybrid's finished request enters the LRU block index by
block index (block k of every group before block k-1), so its prefix outlives its tail."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.managers import PagedManager, VmemManager, make_manager
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request

from .test_paged_hybrid_prefix import BS, PROMPT, manager as hybrid_manager, serve

# 2 layers, one KV head of 8 fp16 dims: 16 bytes a layer-token; 512-byte pages hold 32 tokens
MODEL = ModelSpec("t", 2, 1, 8, 2, 0)
IDS = list(range(1000, 1100))


def vmem(eviction="lru", block_tokens=4):
    return make_manager("vmem", MODEL, 64 * 2048, 256, page_bytes=512, prefix_eviction=eviction,
                        prefix_block_tokens=block_tokens)


def finish(m, seq_id, ids, computed):
    m.allocate(seq_id, len(ids), ids)
    m.mark_computed(seq_id, computed)
    m.free(seq_id, computed_tokens=computed)
    m.check_integrity()


@pytest.mark.parametrize("eviction", ["lru", "hits"])
def test_vmem_cached_tokens_count_published_blocks_not_whole_pages(eviction):
    m = vmem(eviction)
    assert m.tokens_per_page == 32
    finish(m, 0, IDS[:25], 24)           # 20-token prompt + 5 new: 24 computed, 6 blocks
    assert len(m.cached_units()) == 1 and m.cached_tokens == 24        # (was 32: the page)
    other = list(range(5000, 5040))
    finish(m, 1, other, 40)              # page 0 registered (32) + 2 blocks of page 1 (8)
    assert m.cached_tokens == 24 + 40
    hit = m.allocate(2, 33, other[:32] + [1])   # page 0 held again: it leaves the cache
    assert hit == 32 and m.cached_tokens == 24 + 8
    m.free(2)
    assert m.cached_tokens == 24 + 40 + 0        # (seq 2's own page 1: nothing computed)
    assert m.reset_prefix_cache() == 3 and m.cached_tokens == 0
    m.check_integrity()


def test_vmem_cached_tokens_without_blocks_are_whole_pages():
    m = vmem(block_tokens=0)
    finish(m, 0, IDS[:70], 70)           # pages 0, 1 registered; page 2 (6 tokens) not cached
    assert m.cached_tokens == 64 and len(m.cached_units()) == 2


@pytest.mark.parametrize("kind", ["paged", "vmem", "hybrid"])
def test_an_allocation_without_lookup_reads_nothing_counts_nothing_and_publishes(kind):
    m = {"paged": lambda: PagedManager(MODEL, 64 * 2048, 256, block_size_tokens=4),
         "vmem": vmem, "hybrid": hybrid_manager}[kind]()
    prompt = PROMPT                      # 22 tokens: 5 full 4-token blocks
    finish(m, 0, prompt, len(prompt))
    queries, hits = m.prefix_queries, m.prefix_hits
    assert m.can_allocate(len(prompt), prompt, lookup=False)
    assert m.allocate(1, len(prompt), prompt, lookup=False) == 0          # no hit though cached
    assert (m.prefix_queries, m.prefix_hits) == (queries, hits)           # no query counted
    m.mark_computed(1, len(prompt))
    m.free(1)
    m.reset_prefix_cache()
    assert m.cached_tokens == 0
    assert m.allocate(2, len(prompt), prompt, lookup=False) == 0
    m.mark_computed(2, len(prompt))
    m.free(2)                            # computed without a lookup: published, cached ...
    assert m.allocate(3, len(prompt), prompt) == 5 * 4     # ... and found by a plain request
    assert (m.prefix_queries, m.prefix_hits) == (queries + len(prompt), hits + 20)
    m.check_integrity()


def test_reserve_oracle_counts_no_query_without_lookup():
    m = make_manager("reserve-oracle", MODEL, 64 * 2048, 256)
    m.allocate(0, 8, IDS[:8], final_tokens=8, lookup=False)
    m.allocate(1, 8, IDS[:8], final_tokens=8)
    assert m.prefix_queries == 8


def test_prefix_lookup_must_be_a_bool():
    with pytest.raises(ConfigError, match="prefix_lookup"):
        Request(0, 4, 1, prefix_lookup=0)


def test_a_paged_hybrids_finished_request_enters_the_lru_by_block_index():
    m = hybrid_manager(blocks=12)        # 12 blocks over both groups
    serve(m, 0, PROMPT, window=False)
    tables = m.block_tables(0)
    label = {b: (g, k) for g, t in enumerate(tables) for k, b in enumerate(t)}
    m.free(0)
    assert [label[b] for b in m.cached_units()] == \
        [(g, k) for k in range(4, -1, -1) for g in (0, 1)]     # (was group 0's, then group 1's)
    # an unrelated 12-token request takes 3 blocks x 2 groups: 2 free + 4 evicted (blocks 4, 3)
    finish(m, 1, list(range(500, 512)), 12)
    # the prefix's blocks 0..2 of both groups are still there (was 1 block: group 0's 1..4 gone)
    assert m.allocate(2, len(PROMPT), PROMPT) == 3 * BS
    m.check_integrity()
