"""The vmem integrity checks over whole columns (the ledger, the kind table, each group's
extents) still catch every corruption they caught per page and per group: each test corrupts one
field directly after a check that passed, and the next check fails naming the invariant."""
import pytest

from vmemkv.scheduler.layout import PoolBacking
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec

HYBRID = ModelSpec("h", 2, 1, 1, 1, weight_bytes=0, layer_windows=(4, None))   # full + window
THREE_BYTES = ModelSpec("t3", 1, 3, 1, 1, weight_bytes=0)   # 3 bytes per token: BYTES backing


def checked_hybrid():
    """Two kinds (full, window-4) of whole backing, sequence 0 holding groups 0..2."""
    m = make_manager("vmem", HYBRID, 64, 64, page_bytes=1, max_slots=2, hybrid_parts=True)
    m.allocate(0, 3)
    m.check_integrity()
    assert len(m.kinds) == 2 and m.table.members == (2, 2) and 5 in m._spare
    return m


def checked_bytes():
    """One kind of BYTES backing (a group's member spans 3 pages), group 0 holding 1 token."""
    m = make_manager("vmem", THREE_BYTES, 10 * 2 * 4, 16, page_bytes=4, max_slots=2)
    m.allocate(0, 1)
    m.check_integrity()
    assert m.backing is PoolBacking.BYTES and m._seqs[0].units == [0]
    assert m.table.backed(0, 0) == m.geometry.member_pages_for(1) < m.geometry.pages_per_member
    return m


def set_extent(m, k: int, g: int, pages: tuple) -> None:
    m.table._extents[k][g] = pages       # a direct write: what a bug would do


def fails(m, invariant: str) -> None:
    with pytest.raises(AssertionError, match=invariant):
        m.check_integrity()


def test_a_spare_group_given_pages_fails_the_next_check():
    m = checked_hybrid()
    set_extent(m, 1, 5, m.table.ledger.take(2, m.kinds[1].name))
    fails(m, "spare group keeps pages")


def test_kinds_backed_unlike_fail_the_next_check():
    m = checked_hybrid()
    extent = m.table.extent(1, 2)
    set_extent(m, 1, 2, ())
    m.table.ledger.give(extent)          # the ledger and the kind table agree: only unlike
    fails(m, "kinds backed alike")


def test_a_held_group_backed_past_its_fill_fails_the_next_check():
    m = checked_bytes()
    extent = m.table.extent(0, 0)
    set_extent(m, 0, 0, extent + m.table.ledger.take(m.table.members[0], m.kinds[0].name))
    fails(m, "held backing")


def test_a_page_neither_free_nor_held_fails_the_next_check():
    m = checked_hybrid()
    m.table.ledger._free.pop()
    fails(m, r"page \d+ is neither free nor held")


def test_a_page_free_twice_fails_the_next_check():
    m = checked_hybrid()
    ledger = m.table.ledger
    ledger._free.append(ledger._free[0])
    fails(m, "a page is free twice")


def test_a_tenant_count_off_by_one_fails_the_next_check():
    m = checked_hybrid()
    m.table.ledger._held[m.kinds[0].name] += 1
    fails(m, "per-tenant counts")


def test_extents_naming_another_kinds_pages_fail_the_next_check():
    m = checked_hybrid()
    full, window = m.table.extent(0, 1), m.table.extent(1, 1)
    set_extent(m, 0, 1, window)          # counts all agree; the holders do not
    set_extent(m, 1, 1, full)
    fails(m, "holder")


def test_an_extent_of_part_of_a_member_fails_the_next_check():
    m = checked_hybrid()
    extent = m.table.extent(0, 2)
    set_extent(m, 0, 2, extent[:1])
    m.table.ledger.give(extent[1:])
    fails(m, "members")
