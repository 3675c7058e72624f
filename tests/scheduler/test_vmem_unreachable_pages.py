"""vmem caches only the page groups a later prompt can reach. Hits run from a prompt's first
page; a hybrid's group whose windowed kind was released behind the window can never serve
one, and neither can a group chained on an evicted one, so the registrations chained below
such a group go with its own: cached groups among them are given back at once, and the
others are not cached when their requests end. So ``cached_tokens`` (the
``prefix_cache_cached_tokens`` gauge) is exactly what the same tokens then hit, the pool keeps
no pages for the rest, and a later run of the prompt registers it again (before, their stale
registrations held the digests, so the later run could not publish those pages)."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.managers import make_manager

from .prefix_reach_helpers import (B_TOKENS, FULL_ONLY, GEMMA3_LIKE, SHARED_UNIT, WINDOW,
                                   cache_a_and_b_chained_on_it)

TPP = 4                                          # tokens per page (1-byte token-layers)
PROMPT = list(range(100, 114))                   # 14 tokens: 3 full pages
WINDOW_PASSES_PAGE_0_AT = WINDOW + TPP - 1       # 11 computed tokens


def vmem():
    return make_manager("vmem", GEMMA3_LIKE, 64 * 6 * 2 * TPP, 64, page_bytes=TPP,
                        hybrid_parts=True)


def generated(new_tokens):
    return [7 + t for t in range(new_tokens)]


def run(m, sid, ids, new_tokens):
    """Serve ``ids`` and ``new_tokens`` generated tokens as an engine does (the window slides
    after every computed step); returns the prompt tokens hit."""
    hit = m.allocate(sid, len(ids), ids)
    m.mark_computed(sid, len(ids))
    m.release_behind_window(sid, len(ids))
    for t, token in enumerate(generated(new_tokens), start=len(ids) + 1):
        m.append(sid, 1, [token])
        m.mark_computed(sid, t)
        m.release_behind_window(sid, t)
    m.free(sid)
    m.check_integrity()
    return hit


@pytest.mark.parametrize("prompt_tokens", [5, 12, 14])
@pytest.mark.parametrize("new_tokens", [0, 1, 3, 6])
def test_cached_tokens_are_exactly_what_the_same_tokens_then_hit(prompt_tokens, new_tokens):
    """The next request sends the prompt, the generated tokens and one more (so that every
    full page could be hit). Before: with the window past page 0 the later full pages stayed
    cached (14 + 6: 8 tokens, pages 3 and 4; 0 hit)."""
    m = vmem()
    ids = PROMPT[:prompt_tokens]
    run(m, 0, ids, new_tokens)
    cached = m.cached_tokens
    assert len(m.cached_units()) * TPP == cached
    resent = ids + generated(new_tokens) + [0]
    assert m.allocate(1, len(resent), resent) == cached
    if prompt_tokens + new_tokens >= WINDOW_PASSES_PAGE_0_AT:
        assert cached == 0                       # page 0 released: nothing reachable
    m.check_integrity()


def test_pages_after_a_released_one_are_given_back_not_kept_for_the_cache():
    """14 + 6 tokens: pages 0..4 full, pages 0..2's window kind released (20 - 8 + 1 = 13),
    pages 3 and 4 unreachable. The next request with those 20 tokens and one more (6 pages)
    is placed on the same slot and computes in the groups still mapped there: the pool then
    binds its 6 groups and nothing else (before: 2 groups more, cached, none hit)."""
    m = vmem()
    baseline_free_pages = m.free_pages
    run(m, 0, PROMPT, 6)
    assert m.cached_tokens == 0 and m.cached_units() == []   # before: pages 3 and 4
    resent = PROMPT + generated(6) + [0]
    assert m.allocate(1, len(resent), resent) == 0
    assert m.free_pages == baseline_free_pages - 6 * m.pages_per_group
    m.check_integrity()


def test_a_later_run_registers_the_prompt_again_and_the_next_one_hits_it():
    """Run 1 (14 tokens) slides its window past page 0 (14 - 8 + 1 = 7: page 0 released), so
    its pages 1 and 2 cannot be reached; run 2 (10 tokens of the prompt, its window still
    reading page 0) registers pages 0 and 1; run 3 hits both. Before, run 1's stale
    registration of page 1 held its digest: run 2 registered page 0 only, run 3 hit 4 tokens."""
    m = vmem()
    assert run(m, 0, PROMPT, 0) == 0
    assert m.cached_tokens == 0                  # before: 8 (pages 1 and 2)
    assert run(m, 1, PROMPT[:10], 0) == 0
    assert m.cached_tokens == 2 * TPP
    assert run(m, 2, PROMPT, 0) == 2 * TPP


BRANCH = PROMPT[:4] + list(range(50, 58))      # shares page 0 with PROMPT only


def cache_and_branch(m):
    """Run 0 (10 tokens, its window still reading page 0) caches pages 0 and 1; sequence 1
    (``BRANCH``) hits page 0 and computes 12 tokens: 12 - 8 + 1 = 5, so sliding its window
    releases page 0's window kind (the only holder) and then run 0's page 1 cannot be reached."""
    run(m, 0, PROMPT[:10], 0)
    assert m.allocate(1, len(BRANCH), BRANCH) == TPP
    m.mark_computed(1, len(BRANCH))
    assert m.cached_tokens == TPP                # run 0's page 1


def test_a_cached_page_below_one_released_later_is_given_back_at_once():
    """Before: run 0's page 1 stayed cached, unreachable, until evicted (4 tokens)."""
    m = vmem()
    cache_and_branch(m)
    m.release_behind_window(1, len(BRANCH))
    m.check_integrity()
    assert m.cached_tokens == 0 and m.cached_units() == []
    m.free(1)                                    # its pages 1 and 2: below page 0 too
    assert m.cached_tokens == 0
    assert m.allocate(2, 11, PROMPT[:11]) == 0
    m.check_integrity()


def test_a_rolled_back_window_release_keeps_the_cached_page_it_gave_back():
    """What the release drops and gives back is journaled: a rollback restores it all."""
    m = vmem()
    cache_and_branch(m)
    registered, cached = dict(m.prefix.by_unit), m.cached_units()
    m.begin()
    m.release_behind_window(1, len(BRANCH))
    assert m.cached_tokens == 0
    m.rollback()
    m.check_integrity()
    assert dict(m.prefix.by_unit) == registered and m.cached_units() == cached
    assert m.cached_tokens == TPP
    m.release_behind_window(1, len(BRANCH))      # and again, committed: the same result
    m.check_integrity()
    assert m.cached_tokens == 0


def duplicates_cached():
    """A 5-group one-kind pool where A's page 0 and B's page 1 (chained on it) are cached."""
    m = make_manager("vmem", FULL_ONLY, 5 * 12 * TPP, 64, page_bytes=TPP, max_slots=4)
    m.allocate(0, 4, SHARED_UNIT, slot=0)
    m.allocate(1, 4, SHARED_UNIT, slot=1)
    cache_a_and_b_chained_on_it(m)
    assert m.cached_tokens == 2 * TPP
    return m


def test_a_cached_page_chained_on_an_evicted_duplicate_is_given_back_with_it():
    """A and B compute the same 4-token prompt at once (no hit: the last token is always
    computed), so B's page 0 is a duplicate left unregistered and B's page 1 is chained on A's
    page 0. Both finish: A's page 0 and B's page 1 are cached, A's first (lru). C (4 pages of
    a 5-group pool, on a slot of its own) takes the 2 free groups, B's page 0 (still mapped,
    no content) and evicts A's page 0: B's page 1 can no longer be reached and is given back
    with it (before: it stayed cached, 4 tokens that no request could hit)."""
    m = duplicates_cached()
    m.allocate(2, 16, slot=2)
    m.check_integrity()
    assert m.cached_tokens == 0 and m.cached_units() == []
    m.free(2)
    assert m.allocate(3, 9, B_TOKENS + [0], slot=3) == 0     # what was cached: nothing
    m.check_integrity()


def test_reset_prefix_cache_evicts_a_chain_whose_head_goes_first():
    """Evicting A's page 0 (lru: first) gives back B's page 1 with it; the reset still
    empties the cache and counts both."""
    m = duplicates_cached()
    assert m.reset_prefix_cache() == 2
    assert m.cached_tokens == 0 and m.cached_units() == []
    m.check_integrity()
