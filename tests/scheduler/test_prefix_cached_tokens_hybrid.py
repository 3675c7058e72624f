"""``cached_tokens`` (the ``prefix_cache_cached_tokens`` gauge) of hybrid models (full layers
beside sliding-window ones): the tokens the prefix cache keeps for reuse, each counted ONCE. A
paged hybrid keeps a block per block group for each cached prefix node (six on a Gemma-3-like
5 : 1 model); the node's tokens count once, while the block of every full group is cached,
so paged, vmem and a model of one kind report the same number on the same run, and that
number is the hit a later request with the prompt gets."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec

BS = 4                                         # paged block = vmem page (1-byte token-layers)
WINDOW = 8
GEMMA3_LIKE = ModelSpec("g3", 6, 1, 1, 1, weight_bytes=0,
                        layer_windows=(WINDOW,) * 5 + (None,))   # 5 windowed : 1 full
FULL_ONLY = ModelSpec("llama", 6, 1, 1, 1, weight_bytes=0)
PROMPT = list(range(100, 122))                  # 22 tokens: 5 whole blocks (20 tokens)
LATER = PROMPT + [7, 8, 9]                      # a later request resending the prompt


def paged(model=GEMMA3_LIKE, blocks=64):
    return make_manager("paged", model, blocks * BS * 2, 64, block_size_tokens=BS)


def vmem(model=GEMMA3_LIKE):
    return make_manager("vmem", model, 64 * 6 * 2 * BS, 64, page_bytes=BS, hybrid_parts=True)


def serve_and_free(m, sid, ids, window=False):
    """Allocate, compute the prompt (publish), optionally slide the window, finish."""
    m.allocate(sid, len(ids), ids)
    m.mark_computed(sid, len(ids))
    if window:
        m.release_behind_window(sid, len(ids))
    m.free(sid)
    m.check_integrity()


@pytest.mark.parametrize("make", [paged, vmem, lambda: paged(FULL_ONLY)],
                         ids=["paged-hybrid", "vmem-hybrid", "paged-one-kind"])
def test_a_finished_prompt_is_counted_once_and_is_what_a_later_request_hits(make):
    m = make()
    serve_and_free(m, 0, PROMPT)
    assert m.cached_tokens == 5 * BS               # paged hybrid before: 6 groups x 20 = 120
    assert m.allocate(1, len(LATER), LATER) == 5 * BS == m.prefix_hits
    assert m.cached_tokens == 0                    # every cached block held again
    m.mark_computed(1, len(LATER))
    m.free(1)
    m.check_integrity()
    assert m.cached_tokens == 6 * BS               # 25 tokens: 6 whole units


def test_behind_the_window_a_paged_hybrids_full_blocks_still_count():
    """The windowed groups gave back blocks 0..2 (cached: registered, held by nobody); every
    node keeps its full group's block, so all five count and all five are hit."""
    m = paged()
    serve_and_free(m, 0, PROMPT, window=True)
    assert m.cached_tokens == 5 * BS
    assert m.allocate(1, len(LATER), LATER) == 5 * BS
    m.check_integrity()


def test_a_node_whose_full_block_was_evicted_no_longer_counts():
    """37 blocks: a 20-token prompt holds 5 per group (30). Finished, every block is cached;
    an 8-token request (2 blocks per group) takes the 7 free ones and evicts node 4's full
    block (tail first, the full group's first): no hit can use node 4's windowed blocks any
    more, so they are given back with it (before: one stayed cached) and node 4 no longer
    counts."""
    m = paged(blocks=37)
    serve_and_free(m, 0, PROMPT[:20])
    assert m.cached_tokens == 5 * BS
    m.allocate(1, 8)
    m.check_integrity()
    assert len(m.cached_units()) == 4 * 6          # nothing of node 4 left
    assert m.cached_tokens == 4 * BS
    m.free(1)
    assert m.allocate(2, 21, PROMPT[:20] + [7]) == 4 * BS
    m.check_integrity()


def test_a_paged_hybrid_counts_nothing_while_a_request_holds_the_prefix():
    """Held by a running request (its windowed groups gave blocks 0..2 back to the cache),
    no token of the prefix is held ONLY by the cache."""
    m = paged()
    m.allocate(0, len(PROMPT), PROMPT)
    m.mark_computed(0, len(PROMPT))
    m.release_behind_window(0, len(PROMPT))
    assert len(m.cached_units()) == 3 * 5          # 3 blocks of 5 windowed groups
    assert m.cached_tokens == 0
    m.check_integrity()


def test_vmem_hybrid_drops_pages_released_behind_the_window_and_the_prefix_after_them():
    """What docs/models.md states: a vmem page group whose windowed kind was released can no
    longer serve a hit (its full kind is given back with it at the request's end), and the
    pages after it in that prompt cannot be reached (hits run from the first page), so they
    are not cached either: given back like any page nobody can reuse, they count for nothing
    in ``cached_tokens``, and a later request with the prompt computes all of it in them."""
    m = vmem()
    baseline_free_pages = m.free_pages
    serve_and_free(m, 0, PROMPT, window=True)      # pages 0..2 released: 22 - 8 + 1 = 15
    assert m.cached_tokens == 0 and m.cached_units() == []   # pages 3, 4: were cached (8)
    assert m.allocate(1, len(LATER), LATER) == 0
    m.check_integrity()                             # 7 pages held, none kept beside them
    assert m.free_pages == baseline_free_pages - 7 * m.pages_per_group
