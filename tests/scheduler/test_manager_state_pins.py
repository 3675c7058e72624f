"""Manager state and limits pinned exactly: an elastic pool grown back to a size holds that
many pages; the integrity and idle checks catch (and name) the corruption they exist to catch;
swap space is used to its last byte, never past it, and a swap-in counts the adapter it loads."""
import pytest

from vmemkv.scheduler.errors import SlotError, SwapSpaceExhaustedError, TransactionStateError
from vmemkv.scheduler.managers import PagedManager, VmemManager, make_manager
from vmemkv.scheduler.managers.journal import OrderedUnits, TxnCell
from vmemkv.scheduler.presets import ModelSpec

from .adapter_sched import manager as tiny_manager, ref, unit_bytes

UNIFORM = ModelSpec("u4", 4, 1, 2, 2, weight_bytes=0)   # 8 bytes a layer-token
ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)
UNIT = 4


def elastic_pool():
    return make_manager("vmem", UNIFORM, 8 * 256, 16, page_bytes=32, max_slots=4,
                        max_cache_bytes=8 * 256)    # 64 pages: 8 groups of 8


@pytest.mark.parametrize("shrunk_bytes", [0, 256, 3 * 256])
def test_a_pool_grown_back_holds_exactly_the_pages_of_its_new_size(shrunk_bytes):
    m = elastic_pool()
    assert m.resize(shrunk_bytes) == 0
    assert m.cache_bytes == shrunk_bytes
    for size in (5 * 256, 8 * 256):
        assert m.resize(size) == 0
        assert (m.cache_bytes, m.capacity_pages) == (size, size // 32)
        assert m.can_allocate(16)
    m.check_integrity()


def manager(kind, **kw):
    if kind == "paged":
        return PagedManager(ONE_LAYER, 2 * UNIT * 32, 64, block_size_tokens=UNIT, **kw)
    return VmemManager(ONE_LAYER, 2 * UNIT * 32, 16 * UNIT, page_bytes=UNIT, max_slots=8, **kw)


def cache_one_unit(m) -> None:
    """One whole unit (and a token past it) computed by sequence 0 and freed: cached."""
    ids = list(range(UNIT + 1))
    m.allocate(0, len(ids), ids)
    m.mark_computed(0, len(ids))
    m.free(0)


def units_of(m, seq_id):
    if isinstance(m, PagedManager):
        return m.block_table(seq_id)
    pages = m.mapped_pages(m.slot_of(seq_id))
    return [pages[pi] for pi in sorted(pages)]


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_the_integrity_check_catches_a_reference_count_nobody_holds(kind):
    m = manager(kind)
    m.allocate(0, 2 * UNIT + 1, list(range(2 * UNIT + 1)))
    m.check_integrity()
    m._refs[units_of(m, 0)[0]] += 1               # a holder that will never let go
    with pytest.raises(AssertionError, match="reference counts"):
        m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_the_idle_check_catches_tokens_counted_live_with_no_sequence(kind):
    m = manager(kind)
    m.allocate(0, UNIT + 1)
    m.free(0)
    m.check_idle()
    m._live += 1
    with pytest.raises(AssertionError, match="tokens held"):
        m.check_idle()


def test_the_paged_integrity_check_names_a_block_neither_free_held_nor_cached():
    m = manager("paged")
    cache_one_unit(m)
    (block,) = m.cached_units()
    m._cache.remove(block)                        # out of the cache, never back to the pool
    with pytest.raises(AssertionError, match="free . held . cached . adapters == total"):
        m.check_integrity()


def test_the_vmem_idle_check_names_page_groups_held_with_no_sequence():
    m = manager("vmem")
    cache_one_unit(m)
    m.check_idle()
    (group,) = m.cached_units()
    m._cache.remove(group)                        # out of the cache, never back to the pool
    with pytest.raises(AssertionError, match="page groups held with no sequence"):
        m.check_idle()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_a_sequence_that_fills_swap_space_exactly_is_swapped_out(kind):
    bytes_per_token = ONE_LAYER.bytes_per_token
    tokens = 2 * UNIT + 1                              # swap space for exactly these
    if kind == "paged":
        m = PagedManager(ONE_LAYER, 2 * UNIT * 32, 64, block_size_tokens=UNIT,
                         swap_bytes=tokens * bytes_per_token)
    else:
        m = VmemManager(ONE_LAYER, 2 * UNIT * 32, 16 * UNIT, page_bytes=UNIT, max_slots=8,
                        swap_bytes=tokens * bytes_per_token)
    m.allocate(0, tokens)
    m.allocate(1, 1)
    assert m.can_swap_out(0) and m.can_swap_out_all([0])
    assert not m.can_swap_out_all([0, 1])              # each fits alone, not both together
    assert m.swap_out(0) == tokens
    assert m.swap_free_bytes == 0
    assert not m.can_swap_out(1)
    with pytest.raises(SwapSpaceExhaustedError, match="needs 2 bytes of swap space, 0 of 18"):
        m.swap_out(1)                                  # one token past it: refused, unchanged
    assert m.num_tokens(1) == 1 and not m.is_swapped(1)
    m.check_integrity()


def test_swapping_in_with_an_adapter_to_load_counts_the_adapters_pages():
    m = tiny_manager("paged", tokens=128, swap_tokens=64)   # 32 blocks of 4 tokens
    m.allocate(0, 64)
    m.swap_out(0)
    m.allocate(1, 64)                                  # 16 blocks left: exactly seq 0's
    adapter = ref("a", "a", unit_bytes(m))             # one block to load
    assert m.can_swap_in_all([0])
    assert not m.can_swap_in_all([0], adapter=adapter)
    m.check_integrity()


def test_the_integrity_check_catches_a_unit_fill_that_is_not_its_tokens():
    m = manager("vmem")
    m.allocate(0, UNIT + 1)
    m._fill[units_of(m, 0)[1]] += 1               # one token more than the sequence wrote
    m._live += 1                                  # (the live sum agreeing with it)
    with pytest.raises(AssertionError, match="fill"):
        m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_the_integrity_check_catches_cached_tokens_that_are_not_the_cached_units(kind):
    m = manager(kind)
    cache_one_unit(m)
    m.check_integrity()
    m._cache.tokens += UNIT                       # a unit's tokens counted with no unit
    with pytest.raises(AssertionError, match="cached tokens"):
        m.check_integrity()


def test_the_paged_integrity_check_catches_a_cached_block_nobody_can_find():
    m = manager("paged")
    cache_one_unit(m)
    (block,) = m.cached_units()
    m.prefix.drop(block)                          # unregistered, yet kept as if findable
    with pytest.raises(AssertionError):
        m.check_integrity()


def test_a_slot_one_past_the_last_is_refused_by_name():
    m = manager("vmem")
    with pytest.raises(SlotError, match="outside this manager's slots 0..7"):
        m.allocate(0, UNIT, slot=8)
    m.check_idle()


def test_a_rollback_after_the_ordered_set_compacts_keeps_every_key_in_order():
    cell = TxnCell()
    units = OrderedUnits(cell, range(200))
    for key in range(170):
        units.remove(key)                         # 170 stale queue entries, 30 live keys
    cell.open({})
    units.remove(170)
    units.add(500)                                # compacts the queue (170's entry goes)
    cell.rollback([], [])
    assert list(units) == list(range(170, 200))
    assert [units.pop_first() for _ in range(3)] == [170, 171, 172]


def test_the_paged_integrity_check_catches_token_sums_that_are_not_the_tables():
    m = manager("paged")
    m.allocate(0, UNIT + 1)
    m._tok_sum += 1
    with pytest.raises(AssertionError, match="capacity and token sums"):
        m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_a_begin_inside_an_open_transaction_is_refused_and_the_open_one_still_rolls_back(kind):
    m = manager(kind)
    m.begin()
    m.allocate(0, UNIT + 1)
    with pytest.raises(TransactionStateError, match="begin.. inside an open transaction"):
        m.begin()
    m.rollback()
    m.check_idle()                                # the allocation is undone
