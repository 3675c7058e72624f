"""vmem caches only block-granular prefix entries some prompt can hit. Page p's blocks are keyed
on page p-1's digest (blocks.py) and reached only through whole-page hits on pages 0..p-1, so
they go with page p-1's registration (as the registrations below it do, ChainedPrefixIndex),
and a group's last holder drops blocks published after that registration went. Before, such a
group stayed cached though no prompt could reach it: counted in ``cached_tokens`` (the
``prefix_cache_cached_tokens`` gauge), holding a page group that the eviction policy could
rank above a reachable one, so that a later request hit less.

Pages hold 8 tokens, blocks 4 (1-byte token-layers); A and B compute page 0 at once, so B's
copy is an unregistered duplicate and B's page 1 is chained on A's page 0."""
from __future__ import annotations

from vmemkv.scheduler.managers import make_manager

from .prefix_reach_helpers import FULL_ONLY

PAGE_TOKENS, BLOCK_TOKENS = 8, 4
PAGE_0 = list(range(100, 108))                    # A's prompt, B's first page
B_PAGE_1 = list(range(50, 58))
OTHER = list(range(200, 209))                     # a prompt sharing nothing: page 0 and 1 token


def vmem(groups: int = 4, evict: str = "lru"):
    return make_manager("vmem", FULL_ONLY, groups * 6 * 2 * PAGE_TOKENS, 64,
                        page_bytes=PAGE_TOKENS, max_slots=4, prefix_block_tokens=BLOCK_TOKENS,
                        prefix_eviction=evict)


def run(m, sid: int, ids: list) -> int:
    hit = m.allocate(sid, len(ids), ids)
    m.mark_computed(sid, len(ids))
    m.free(sid)
    return hit


def a_and_b_chained_on_it(m, b_page_1: list) -> None:
    """A (sequence 0) holds page 0; B (1) holds its duplicate and ``b_page_1`` after it."""
    m.allocate(0, PAGE_TOKENS, PAGE_0)
    m.allocate(1, PAGE_TOKENS + len(b_page_1), PAGE_0 + b_page_1)
    m.mark_computed(0, PAGE_TOKENS)
    m.mark_computed(1, PAGE_TOKENS + len(b_page_1))


def test_a_reachable_page_is_kept_before_blocks_no_prompt_reaches():
    """A's page 0 is evicted while B runs (B's page 1 can then be reached no more); B ends:
    its page 1 now goes back at once (before: cached, 8 tokens), so memory needed later takes
    it, not the other prompt's cached page, which the same prompt then hits (before: 0)."""
    for evict in ("lru", "hits"):
        m = vmem(evict=evict)
        a_and_b_chained_on_it(m, B_PAGE_1)
        m.free(0)
        assert run(m, 2, OTHER) == 0                 # takes the last free group, evicts A's
        run(m, 3, [7, 7, 7])                         # a page nothing retains
        m.free(1)
        assert m.cached_tokens == 2 * PAGE_TOKENS    # OTHER's page 0, B's page 0 (blocks)
        assert len(m.cached_units()) == 2            # before: 24 tokens, 3 groups
        m.allocate(4, 9, [9] * 9)                    # two groups: no group cached is needed
        m.check_integrity()
        assert m.allocate(5, len(OTHER), OTHER) == PAGE_TOKENS
        m.check_integrity()


def test_blocks_after_an_evicted_page_go_with_it():
    """B ends with one block of page 1 (4 tokens); A's page 0 is evicted: B's page 1 goes
    back with it (before: cached, unreachable, 4 of the 12 tokens counted)."""
    m = vmem()
    a_and_b_chained_on_it(m, B_PAGE_1[:BLOCK_TOKENS])
    m.free(0)
    m.free(1)
    assert m.cached_tokens == PAGE_TOKENS + PAGE_TOKENS + BLOCK_TOKENS
    free_pages_before = m.free_pages
    m.allocate(2, 9, OTHER)                          # the free group, then A's page 0
    m.check_integrity()
    assert m.cached_tokens == PAGE_TOKENS            # B's page 0 (blocks): what a copy hits
    assert len(m.cached_units()) == 1
    assert m.free_pages == free_pages_before         # B's page 1 went back whole (WHOLE)
    m.free(2)                                        # (room to hold a copy's source)
    resent = PAGE_0 + B_PAGE_1[:BLOCK_TOKENS] + [0]
    assert m.allocate(3, len(resent), resent) == PAGE_TOKENS
    m.check_integrity()


def test_blocks_published_after_their_page_went_are_not_cached():
    """B computes its page 1 after A's page 0 was evicted (no prompt reaches those blocks):
    when B ends they are dropped, and the group goes back (before: cached, 4 tokens)."""
    m = vmem(groups=5)
    m.allocate(0, PAGE_TOKENS, PAGE_0)
    m.allocate(1, PAGE_TOKENS + 1, PAGE_0 + [50])
    m.mark_computed(0, PAGE_TOKENS)
    m.mark_computed(1, PAGE_TOKENS + 1)
    m.free(0)
    run(m, 2, OTHER)                                 # the free groups
    run(m, 3, list(range(300, 309)))                 # evicts A's page 0
    assert not any(reg.key.tokens == PAGE_0 for reg in m.prefix.by_unit.values())
    m.append(1, 3, [51, 52, 53])
    m.mark_computed(1, PAGE_TOKENS + BLOCK_TOKENS)   # one whole block of page 1, orphaned
    cached_before = m.cached_tokens
    m.free(1)
    m.check_integrity()
    assert m.cached_tokens == cached_before + PAGE_TOKENS   # B's page 0 (blocks) alone


def test_a_rolled_back_eviction_restores_the_blocks_it_dropped():
    """Inside a transaction the eviction gives B's page 1 back with A's page 0; a rollback
    restores both, blocks included, and the same prompt then hits B's page 1 again."""
    m = vmem()
    a_and_b_chained_on_it(m, B_PAGE_1[:BLOCK_TOKENS])
    m.free(0)
    m.free(1)
    blocks, cached, tokens = dict(m.blocks.by_group), m.cached_units(), m.cached_tokens
    m.begin()
    m.allocate(2, 9, OTHER)
    assert m.cached_tokens == PAGE_TOKENS
    m.rollback()
    assert dict(m.blocks.by_group) == blocks
    assert m.cached_units() == cached and m.cached_tokens == tokens
    m.check_integrity()
    resent = PAGE_0 + B_PAGE_1[:BLOCK_TOKENS] + [0]
    assert m.allocate(3, len(resent), resent) == PAGE_TOKENS + BLOCK_TOKENS
    m.check_integrity()
