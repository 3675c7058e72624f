"""Giving back behind a sliding window (window.py, UnitOps.release_behind_window), token by
token: exactly the units wholly before the first key the next query reads
(``computed - W + 1``) go, never the last one; a sequence that gave any back is never swapped
out (its copy would read unmapped memory), and what went is free again. Both unit layouts."""
import pytest

from vmemkv.scheduler.managers import PagedManager, VmemManager
from vmemkv.scheduler.managers.window import WindowSwapError
from vmemkv.scheduler.presets import ModelSpec

UNIT = 4                                                            # tokens per block / page


def manager(kind, window):
    model = ModelSpec("w", 1, 1, 1, 1, weight_bytes=0, layer_windows=(window,))
    if kind == "paged":
        return PagedManager(model, 2 * UNIT * 32, 64, block_size_tokens=UNIT,
                            swap_bytes=1 << 20)
    return VmemManager(model, 2 * UNIT * 32, 16 * UNIT, page_bytes=UNIT, max_slots=8,
                       swap_bytes=1 << 20)


def dropped(m, seq_id):
    """Leading units given back: None in the block table, or page indexes no longer mapped."""
    if isinstance(m, PagedManager):
        table = m.block_table(seq_id)
        return next(i for i, b in enumerate(table) if b is not None)
    return min(m.mapped_pages(m.slot_of(seq_id)))


@pytest.mark.parametrize("window", [1, 6])       # 1: the last unit is wholly behind it too
@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_exactly_the_units_wholly_behind_the_window_go_token_by_token(kind, window):
    m = manager(kind, window)
    free_at_start = m.stats().free_tokens
    m.allocate(0, 1)                    # no ids: nothing cached, all that goes is free
    for n in range(1, 30):
        m.mark_computed(0, n)
        m.release_behind_window(0, n)
        units = -(-n // UNIT)
        expected = min(max(n - window + 1, 0) // UNIT, units - 1)
        assert dropped(m, 0) == expected, n
        assert m.can_swap_out(0) == (expected == 0), n
        held_tokens = (units - expected) * UNIT
        assert m.stats().free_tokens == free_at_start - held_tokens, n
        m.check_integrity()
        m.append(0, 1)
    with pytest.raises(WindowSwapError):
        m.swap_out(0)
    m.free(0)
    m.check_idle()                        # nothing held with no sequence (vmem: pages still
    assert m.can_allocate(64)             # mapped under the freed slot are reclaimable)


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_no_sibling_share_from_a_sequence_that_gave_units_back(kind):
    m = manager(kind, 6)
    ids = list(range(20))
    m.allocate(0, 20, ids)
    m.mark_computed(0, 20)
    m.release_behind_window(0, 20)                    # units 0..2 given back
    assert dropped(m, 0) == 3
    free = m.stats().free_tokens
    assert m.allocate(1, 20, ids, share_from=(0, 16)) == 0     # nothing to share: all computed
    assert m.stats().free_tokens == free - 20
    m.check_integrity()


def test_evicting_a_windowed_block_behind_the_window_keeps_the_hit_that_starts_past_it():
    """A paged hybrid (a full and a windowed block group): a windowed group's block goes from
    the index alone (paged_groups.GroupPrefixIndex.drop), so a prompt whose window starts
    past it still hits every block it reads."""
    model = ModelSpec("g2", 2, 1, 1, 1, weight_bytes=0, layer_windows=(6, None))
    m = PagedManager(model, 2 * 16 * UNIT, 64, block_size_tokens=UNIT)    # 16 blocks
    prompt = list(range(4 * UNIT + 1))
    m.allocate(0, len(prompt), prompt)
    m.mark_computed(0, len(prompt))
    m.release_behind_window(0, len(prompt))       # windowed blocks 0..2 given back: cached
    assert len(m.cached_units()) == 3
    m.allocate(1, 4 * UNIT)                       # 8 blocks: 6 free, 2 evicted (blocks 0, 1)
    assert len(m.cached_units()) == 1
    m.free(1)
    assert m.allocate(2, len(prompt), prompt) == 4 * UNIT    # its window reads blocks 2, 3
    m.check_integrity()
