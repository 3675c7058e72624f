"""Manager transactions: ``rollback`` leaves a manager exactly as if the calls since ``begin``
never ran (every field, every later result), by an undo journal every field is covered by."""
import pytest

from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec

from .shadow import dump

ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token
POLICIES = ["reserve-max", "reserve-oracle", "paged", "vmem"]


def build(policy):
    return make_manager(policy, ONE_LAYER, 2 * 4 * 40, 32, block_size_tokens=4, page_bytes=4,
                        max_slots=8, swap_bytes=2 * 64)


def twins(policy):
    """Two managers in the same state: one to run a transaction on, one to compare with."""
    pair = build(policy), build(policy)
    for m in pair:
        preamble(m)
    return pair


def preamble(m):
    m.allocate(0, 9, list(range(9)), final_tokens=20)
    m.allocate(1, 6, [1, 1, 1, 1, 2, 2], final_tokens=12)
    m.allocate(2, 5, [1, 1, 1, 1, 3], final_tokens=12)     # shares unit 0 with 1 (paged/vmem)
    m.swap_out(2)
    m.take_ops()


def calls_to_undo(m):
    """Every kind of in-place change: records grow their ids, keys and units, a shared last
    unit is copied on write, one record loses its ids (a gap), one moves to swap and back."""
    m.append(0, 3, [9, 10, 11])                # fills unit 2: a new key is appended
    m.fork(1, 5)
    m.append(5, 1, [4])                        # copy-on-write of the shared partial unit
    m.append(1, 2)                             # ids unknown: the record forgets its ids
    m.swap_out(0)
    m.swap_in(0)
    m.swap_in(2)
    m.free(1, computed_tokens=3)
    m.allocate(6, 7, [1, 1, 1, 1, 2, 2, 7], final_tokens=12)
    m.take_ops()                               # drained inside: rollback brings back none


def follow_up(m):
    """Calls whose results depend on everything a rollback must restore."""
    out = [m.allocate(7, 9, list(range(9)) + [1], final_tokens=16),
           m.allocate(8, 5, [1, 1, 1, 1, 5], final_tokens=10)]
    m.append(0, 3, [9, 10, 11])
    m.swap_in(2)
    m.free(1)
    out += [m.take_ops(), m.stats(), m.prefix_hits, m.prefix_queries,
            sorted(m.num_tokens(s) for s in (0, 2, 7, 8))]
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("end", ["rollback", "commit"])
def test_rollback_is_as_if_the_calls_never_ran_and_commit_as_if_run_plainly(policy, end):
    m, twin = twins(policy)
    m.begin()
    calls_to_undo(m)
    getattr(m, end)()
    if end == "commit":
        calls_to_undo(twin)
    assert not m.in_transaction
    assert dump(m) == dump(twin)
    m.check_integrity()
    if end == "rollback":                      # every later result is the same, too
        assert follow_up(m) == follow_up(twin)
        assert dump(m) == dump(twin)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_field_is_covered_by_the_journal_and_a_new_one_is_caught(policy):
    """A field added to a manager (or to one of its helpers) that the undo journal does not
    cover fails here, instead of silently keeping its changes across a rollback."""
    m = build(policy)
    preamble(m)
    assert m.journal_gaps() == []
    m._new_table = [0, 1]
    assert m.journal_gaps() == ["_new_table"]
    del m._new_table
    if hasattr(m, "prefix"):
        m.prefix.new_index = {}
        assert m.journal_gaps() == ["prefix"]


def test_only_the_journal_module_reads_the_journal():
    """Call sites log through the cell (``active``, ``log``, ``set``, ``record``, ...): no
    manager file reads the journal itself, and no field stands in for "a transaction is open"."""
    import pathlib
    import re

    import vmemkv.scheduler.managers as managers
    readers = {path.name for path in pathlib.Path(managers.__file__).parent.glob("*.py")
               if path.name != "journal.py"
               and re.search(r"cell\.(j|undo|units|records|fields)\b|_hot_limit", path.read_text())}
    assert readers == set()
    cell = managers.journal.TxnCell()
    assert not cell.active and cell.size() == 0
    cell.open({"x": 1})
    items = managers.journal.JList(cell, [1])
    items.append(2)
    assert cell.active and cell.size() == 2      # one saved field, one logged append
    assert cell.rollback([], []) == {"x": 1} and items == [1] and not cell.active


@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_an_append_inside_the_last_unit_then_one_taking_a_unit_both_roll_back(policy):
    """The first append stays in the last unit (the journal saves only the record's length);
    the second takes a new unit, so the whole record is saved then: rollback undoes both."""
    m, twin = twins(policy)
    for manager in (m, twin):
        manager.allocate(9, 5, final_tokens=12)    # no ids: its appends may take the hot path
        manager.take_ops()
    m.begin()
    m.append(9, 1)                             # 6 tokens: inside its second unit
    m.append(9, 3)                             # 9 tokens: a third unit
    m.rollback()
    assert dump(m) == dump(twin)
    m.check_integrity()
    assert follow_up(m) == follow_up(twin)
