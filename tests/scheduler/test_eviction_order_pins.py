"""The ``hits`` eviction policy's order, as its docstring states it (eviction.py): a unit's
priority is the clock at its release plus its value (hits served, +1 for prompt tokens); the
lowest goes first and the clock rises to it. Checked on the policy alone, outside and inside a
manager transaction (the heap is journaled there), then as the managers give the values: a
fork's shared prompt units, the first wholly generated unit, a unit that served a hit."""
import pytest

from vmemkv.scheduler.managers import PagedManager, VmemManager
from vmemkv.scheduler.managers.eviction import make_eviction
from vmemkv.scheduler.managers.journal import TxnCell
from vmemkv.scheduler.presets import ModelSpec


def hits_policy(in_transaction):
    cell = TxnCell()
    if in_transaction:
        cell.open({})
    return make_eviction("hits", cell), cell


@pytest.mark.parametrize("in_transaction", [False, True])
def test_a_generated_unit_goes_before_a_prompt_unit_released_earlier(in_transaction):
    policy, _ = hits_policy(in_transaction)
    policy.add(1, 4)                   # prompt tokens: value 1
    policy.note_generated(2)
    policy.add(2, 4)                   # generated tokens: value 0, so it goes first
    assert [policy.pop(), policy.pop()] == [2, 1]
    assert policy.tokens == 0 and len(policy) == 0


@pytest.mark.parametrize("in_transaction", [False, True])
def test_the_clock_rises_to_each_eviction_so_a_later_release_outranks_an_old_hit(in_transaction):
    policy, _ = hits_policy(in_transaction)
    policy.note_hit(1)
    policy.add(1, 4)                   # priority 0 + (1 hit + 1 prompt) = 2
    policy.add(2, 4)                   # priority 0 + 1
    assert policy.pop() == 2           # the clock rises to 1
    policy.add(3, 4)                   # priority 1 + 1 = 2: ties with unit 1, added later
    assert [policy.pop(), policy.pop()] == [1, 3]


@pytest.mark.parametrize("in_transaction", [False, True])
def test_hit_counts_start_again_when_a_units_content_is_dropped(in_transaction):
    policy, _ = hits_policy(in_transaction)
    for _ in range(3):
        policy.note_hit(1)
    policy.forget(1)                   # new content: its old hits are not its own
    policy.add(1, 4)                   # priority 0 + 1
    policy.note_hit(2)
    policy.add(2, 4)                   # priority 0 + 2
    assert [policy.pop(), policy.pop()] == [1, 2]


def test_the_heap_order_holds_for_many_units_inside_a_transaction():
    policy, cell = hits_policy(True)
    values = [5, 0, 3, 1, 4, 2, 6, 0, 2]
    for unit, hits in enumerate(values):
        for _ in range(hits):
            policy.note_hit(unit)
        policy.add(unit, 1)
    popped = [policy.pop() for _ in values]
    # value = hits + 1; each pop raises the clock, which later adds do not see (none here)
    assert popped == sorted(range(len(values)), key=lambda u: (values[u], u))


# -- the same values as a manager gives them (UnitOps: prompt units, generated units, hits) --

ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)
GEMMA2_LIKE = ModelSpec("g2", 2, 1, 1, 1, weight_bytes=0, layer_windows=(64, None))
UNIT = 4
KINDS = [("paged", ONE_LAYER), ("vmem", ONE_LAYER), ("paged", GEMMA2_LIKE)]


def hits_manager(kind, model):
    if kind == "paged":
        return PagedManager(model, 4 * UNIT * 32, 64, block_size_tokens=UNIT,
                            prefix_eviction="hits")
    return VmemManager(model, 2 * UNIT * 32, 16 * UNIT, page_bytes=UNIT, max_slots=8,
                       prefix_eviction="hits")


def run_and_free(m, seq_id, ids, generated=0):
    """A request's whole life: its prompt computed, ``generated`` tokens appended, freed."""
    m.allocate(seq_id, len(ids), ids)
    m.mark_computed(seq_id, len(ids))
    if generated:
        m.append(seq_id, generated, list(range(100, 100 + generated)))
        m.mark_computed(seq_id, len(ids) + generated)
    m.free(seq_id)


def cached_since(m, before):
    return [u for u in m.cached_units() if u not in before]


@pytest.mark.parametrize("kind,model", KINDS)
def test_a_forked_samples_shared_prompt_units_keep_their_prompt_value(kind, model):
    m = hits_manager(kind, model)
    run_and_free(m, 0, [7] * (UNIT + 1))
    first = m.cached_units()                           # value 1, released first
    prompt = list(range(2 * UNIT + 1))
    m.allocate(1, len(prompt), prompt)
    m.fork(1, 2)                                       # before its prompt is computed
    m.mark_computed(2, len(prompt))
    m.mark_computed(1, len(prompt))
    m.free(2)
    m.free(1)
    assert m.cached_units()[:len(first)] == first      # the prompt units go after it


@pytest.mark.parametrize("kind,model", KINDS)
def test_the_first_wholly_generated_unit_is_evicted_before_prompt_units(kind, model):
    m = hits_manager(kind, model)
    run_and_free(m, 0, [7] * (UNIT + 1))
    first = m.cached_units()
    run_and_free(m, 1, list(range(2 * UNIT)), generated=UNIT + 1)   # unit 2: generated
    order = m.cached_units()
    groups = len(first)                                # (request 0 cached one unit a group)
    assert len(order) == 4 * groups                    # its units 0, 1 (prompt), 2 (generated)
    assert sorted(order[groups:2 * groups]) == sorted(first)   # only unit 2 goes before them


@pytest.mark.parametrize("kind,model", KINDS)
def test_a_unit_that_served_a_hit_outlives_one_released_after_it(kind, model):
    m = hits_manager(kind, model)
    run_and_free(m, 0, [1] * (UNIT + 1))
    hit = m.cached_units()
    run_and_free(m, 1, [2] * (UNIT + 1))
    run_and_free(m, 2, [1] * (UNIT + 1))               # hits request 0's unit
    before = m.cached_units()
    run_and_free(m, 3, [3] * (UNIT + 1))
    later = cached_since(m, before)
    order = m.cached_units()
    assert max(map(order.index, later)) < min(map(order.index, hit))
