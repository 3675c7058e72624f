"""The paged manager caches only the blocks a later prompt can reach (as vmem does:
test_vmem_unreachable_pages.py). Two requests computing the same block at once leave one copy
unregistered, and the other request's next block is chained on the first copy; hits run from
a prompt's first block, so once that copy is evicted the block chained on it can never be hit
again. It is given back with the evicted one (journaled), not left cached: before, it stayed
counted in ``cached_tokens``, held a pool block and (one-kind models) held its digest, so a
later run of the same prompt could not register that block again. On a hybrid (paged_groups.py)
a hit reads every full group's block of every prefix node, so dropping one drops everything at
its node and below, while a windowed block behind the window goes alone (hits past it still
read what follows)."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.managers import make_manager

from .prefix_reach_helpers import (B_TOKENS, FULL_ONLY, GEMMA3_LIKE, SHARED_UNIT,
                                   cache_a_and_b_chained_on_it)

BS = 4                                            # tokens per block
GROUPS = {FULL_ONLY: 1, GEMMA3_LIKE: 6}           # block groups: 1 full (+ 5 windowed)
OTHER = list(range(900, 904))                     # shares nothing


def paged(model, blocks):
    m = make_manager("paged", model, blocks * BS * 2 * 6 // GROUPS[model], 64,
                     block_size_tokens=BS)
    assert m.num_blocks == blocks
    return m


def duplicates_cached(model):
    """A pool of 3 blocks per group: A's block 0 and B's block 1 (B's block 0 a duplicate of
    A's, left unregistered and given back; B's block 1 chained on A's) cached, A's first (lru)."""
    groups = GROUPS[model]
    m = paged(model, 3 * groups)
    for sid in (0, 1):
        assert m.allocate(sid, 4, SHARED_UNIT) == 0    # (the last token is always computed)
    cache_a_and_b_chained_on_it(m)
    assert m.cached_tokens == 2 * BS and len(m.cached_units()) == 2 * groups
    m.check_integrity()
    return m


@pytest.mark.parametrize("model", [FULL_ONLY, GEMMA3_LIKE], ids=["one-kind", "hybrid"])
def test_a_cached_block_chained_on_an_evicted_duplicate_is_given_back_with_it(model):
    """C (two blocks per group, unrelated) takes the free ones and evicts A's block 0 (its full
    group's first, on a hybrid): B's block 1 can no longer be reached and is given back with it
    (before: 4 tokens stayed cached, no request could hit them)."""
    m = duplicates_cached(model)
    assert m.allocate(2, 8, OTHER * 2) == 0
    m.check_integrity()
    assert m.cached_tokens == 0 and m.cached_units() == []
    assert m.stats().free_tokens == GROUPS[model] * BS
    m.free(2)
    assert m.allocate(3, 9, B_TOKENS + [0]) == 0          # what was cached: nothing
    m.check_integrity()


@pytest.mark.parametrize("model", [FULL_ONLY, GEMMA3_LIKE], ids=["one-kind", "hybrid"])
def test_a_rolled_back_eviction_keeps_the_block_it_gave_back(model):
    """What the eviction drops and gives back is journaled: a rollback restores it all."""
    m = duplicates_cached(model)
    registered, cached = dict(m.prefix.by_unit), m.cached_units()
    m.begin()
    m.allocate(2, 8, OTHER * 2)
    assert m.cached_tokens == 0
    m.rollback()
    m.check_integrity()
    assert dict(m.prefix.by_unit) == registered and m.cached_units() == cached
    assert m.cached_tokens == 2 * BS
    m.allocate(2, 8, OTHER * 2)                     # and again, committed: the same result
    m.check_integrity()
    assert m.cached_tokens == 0


@pytest.mark.parametrize("model", [FULL_ONLY, GEMMA3_LIKE], ids=["one-kind", "hybrid"])
def test_reset_prefix_cache_evicts_a_chain_whose_head_goes_first(model):
    """Evicting A's block 0 (lru: first) gives back B's block 1 with it; the reset still
    empties the cache and counts every block it held."""
    m = duplicates_cached(model)
    assert m.reset_prefix_cache() == 2 * GROUPS[model]
    assert m.cached_tokens == 0 and m.cached_units() == []
    assert m.stats().free_tokens == m.num_blocks * BS
    m.check_integrity()


def test_a_later_run_registers_the_prompt_again_and_the_next_one_hits_it():
    """One-kind: after the eviction, a run of B's 8 tokens registers both its blocks and the
    next run hits them. Before, B's stale block 1 (chained on the evicted block) held its
    digest: the later run registered block 0 only and the next one hit 4 tokens."""
    m = duplicates_cached(FULL_ONLY)
    m.allocate(2, 8, OTHER * 2)
    m.free(2, computed_tokens=0)                    # (nothing of C's kept: B's block 1 stays)
    assert m.allocate(3, 8, B_TOKENS) == 0
    m.mark_computed(3, 8)
    m.free(3)
    assert m.allocate(4, 9, B_TOKENS + [0]) == 2 * BS
    m.check_integrity()


def test_a_windowed_block_behind_the_window_goes_alone_and_later_hits_read_past_it():
    """Hybrid: A's 16 tokens slide the window past blocks 0 and 1 (16 - 8 + 1 = 9): their
    windowed blocks are unheld and cached, the oldest in the cache. Evicting one of them
    drops nothing else (a hit of 16 tokens reads the windowed groups' blocks 2 and 3 only),
    so the next run of the prompt hits all 16 tokens."""
    m = paged(GEMMA3_LIKE, 5 * 6 + 5)
    ids = list(range(100, 116))
    m.allocate(0, 16, ids)
    m.mark_computed(0, 16)
    m.release_behind_window(0, 16)
    registered = len(m.prefix.by_unit)
    assert len(m.cached_units()) == 2 * 5
    m.allocate(1, 8, OTHER + OTHER)                  # 11 free blocks, 12 needed: one evicted
    m.check_integrity()
    assert len(m.prefix.by_unit) == registered - 1 and len(m.cached_units()) == 2 * 5 - 1
    m.free(0)
    m.free(1)
    assert m.allocate(2, 17, ids + [0]) == 16
    m.check_integrity()


@pytest.mark.parametrize("model", [FULL_ONLY, GEMMA3_LIKE], ids=["one-kind", "hybrid"])
def test_a_held_block_chained_on_an_evicted_one_is_not_cached_when_its_request_ends(model):
    """A's block 0 is cached when B computes the same 4 tokens (no hit: the last token is
    always computed) and a block after them, chained on A's. The reset evicts A's block: B's
    block 1 (held) loses its registration with it, so B's end caches nothing (before: its 4
    tokens, which no request could hit; the hypothesis machine found this path)."""
    m = paged(model, 5 * GROUPS[model])
    m.allocate(0, 4, SHARED_UNIT)
    m.free(0)
    assert m.allocate(1, 4, SHARED_UNIT) == 0
    m.mark_computed(1, 4)
    m.append(1, 4, B_TOKENS[4:])
    m.mark_computed(1, 8)
    assert m.reset_prefix_cache() == GROUPS[model]
    m.check_integrity()
    assert dict(m.prefix.by_unit) == {}
    m.free(1)
    assert m.cached_tokens == 0 and m.cached_units() == []
    m.check_integrity()
