"""Table edits against a shadow: after every step, a cache's replica built only from the edits a
tracker sent equals the manager's tables, and a step that moved nothing sends nothing."""
from __future__ import annotations

import pickle

from hypothesis import given, settings, strategies as st

from vmemkv.runtime.cache import PagedKVCache, VMemKVCache
from vmemkv.runtime.config import CacheConfig
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.plan import EditBlocks, SetSlot
from vmemkv.scheduler.tables import tracker_for

CONFIG = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=4, max_context=64)
ACTIONS = st.lists(st.tuples(st.sampled_from(["admit", "grow", "fork", "free", "swap"]),
                             st.integers(0, 7), st.integers(1, 9)), max_size=40)


def build(kind: str):
    model = CONFIG.model_spec()
    if kind == "paged":
        manager = make_manager("paged", model, 40 * 4 * CONFIG.bytes_per_token, 64,
                               block_size_tokens=4, swap_bytes=1 << 20)
        return manager, PagedKVCache(CONFIG, manager.block_size, manager.num_blocks)
    manager = make_manager("vmem", model, 8 * 4096 * 4, 64, page_bytes=4096, max_slots=4,
                           swap_bytes=1 << 20)
    return manager, VMemKVCache(CONFIG, manager.geometry, manager.num_groups)


def act(manager, live: dict, swapped: set, action, pick: int, n: int, next_id: int) -> list:
    """One manager call; returns the seq ids it dropped (freed or swapped out)."""
    ids = sorted(live)
    seq = ids[pick % len(ids)] if ids else None
    if action == "admit" and manager.can_allocate(n):
        manager.allocate(next_id, n)
        live[next_id] = n
    elif action == "grow" and seq is not None and manager.can_append(seq, n) and live[seq] + n <= 64:
        manager.append(seq, n)
        live[seq] += n
    elif action == "fork" and seq is not None and manager.can_fork(seq):
        manager.fork(seq, next_id)
        live[next_id] = live[seq]
    elif action == "free" and seq is not None:
        manager.free(seq)
        del live[seq]
        return [seq]
    elif action == "swap" and seq is not None and manager.can_swap_out(seq):
        manager.swap_out(seq)
        swapped.add(seq)
        del live[seq]
        return [seq]
    elif action == "swap" and swapped:
        back = min(swapped)
        if manager.can_swap_in(back):
            manager.swap_in(back)
            swapped.discard(back)
            live[back] = manager.num_tokens(back)
    return []


def check_replica_follows_manager(kind: str, actions) -> None:
    manager, cache = build(kind)
    tracker = tracker_for(kind)
    live, swapped = {}, set()
    with cache:
        for step, (action, pick, n) in enumerate(actions):
            dropped = act(manager, live, swapped, action, pick, n, next_id=100 + step)
            cache.execute(manager.take_ops())
            before = {s: cache.placement(s) for s in cache.placed_seq_ids}
            edits = pickle.loads(pickle.dumps(tracker.edits(manager, sorted(live), dropped)))
            cache.apply_tables(edits)
            for seq_id in live:
                truth = manager.slot_of(seq_id) if kind == "vmem" else tuple(manager.block_tables(seq_id))
                assert cache.placement(seq_id) == truth, (step, seq_id)
                moved = before.get(seq_id) != truth
                sent = [e for e in edits if isinstance(e, (SetSlot, EditBlocks)) and e.seq_id == seq_id]
                assert bool(sent) == moved, (step, seq_id, sent)   # changes only
            assert set(cache.placed_seq_ids) == set(live)


@settings(max_examples=60, deadline=None)
@given(ACTIONS)
def test_paged_replica_equals_manager_tables_and_only_changes_are_sent(actions):
    check_replica_follows_manager("paged", actions)


@settings(max_examples=60, deadline=None)
@given(ACTIONS)
def test_vmem_replica_equals_manager_slots_and_only_changes_are_sent(actions):
    check_replica_follows_manager("vmem", actions)


def test_growth_inside_a_block_sends_nothing_and_growth_past_it_sends_the_tail_only():
    manager, cache = build("paged")
    tracker = tracker_for("paged")
    manager.allocate(0, 5)                          # blocks [a, b]
    first = tracker.edits(manager, [0])
    assert first == [EditBlocks(0, 0, tuple(manager.block_table(0)))]
    manager.append(0, 2)                            # 7 tokens: still two blocks
    assert tracker.edits(manager, [0]) == []
    manager.append(0, 2)                            # 9 tokens: a third block
    assert tracker.edits(manager, [0]) == [EditBlocks(0, 2, (manager.block_table(0)[2],))]
    cache.close()


def test_bad_table_edits_raise_and_change_nothing():
    import pytest
    from vmemkv.runtime.errors import CacheStateError
    from vmemkv.scheduler.plan import DropTable
    cases = {
        "paged": [([EditBlocks(0, 3, ())], ["keeps 3 blocks of sequence 0", "has 2"]),
                  ([EditBlocks(0, 2, (999,))], ["blocks [999]", "outside"]),
                  ([SetSlot(0, 1)], ["cannot apply table edit 0"])],
        "vmem": [([SetSlot(0, 4)], ["slot 4", "outside 0..3"]),
                 ([DropTable(0), EditBlocks(0, 0, (1,))], ["cannot apply table edit 1"])],
    }
    for kind, bad in cases.items():
        manager, cache = build(kind)
        with cache:
            manager.allocate(0, 5)
            cache.execute(manager.take_ops())
            cache.apply_tables(tracker_for(kind).edits(manager, [0]))
            before = cache.placement(0)
            for edits, words in bad:
                with pytest.raises(CacheStateError) as info:
                    cache.apply_tables(edits)
                assert all(w in str(info.value) for w in words), str(info.value)
                assert cache.placement(0) == before and cache.placed_seq_ids == [0]
            with pytest.raises(CacheStateError, match="sequence 7 has no placement"):
                cache.begin_step([(7, 0, 1)])


def test_a_swap_naming_the_slot_past_the_last_is_refused_before_touching_memory():
    import pytest
    from vmemkv.runtime.errors import CacheStateError
    from vmemkv.scheduler.managers import SwapIn, SwapOut
    manager, cache = build("vmem")
    with cache:
        manager.allocate(0, 5)
        cache.execute(manager.take_ops())
        for op in (SwapOut(0, 5, slot=4), SwapIn(0, 5, slot=4)):
            with pytest.raises(CacheStateError, match=r"names slot 4 outside 0\.\.3"):
                cache.execute([op])
            assert cache.swapped_tokens() == {}
        cache.check_integrity()


def test_two_sequences_placed_on_one_slot_are_refused_at_the_step():
    import pytest
    from vmemkv.runtime.errors import CacheStateError
    manager, cache = build("vmem")
    with cache:
        manager.allocate(0, 5)
        cache.execute(manager.take_ops())
        slot = manager.slot_of(0)
        cache.apply_tables([SetSlot(0, slot), SetSlot(1, slot)])    # a broken tracker's edits
        shared = rf"sequences \[0, 1\] share slots \[{slot}, {slot}\]"
        with pytest.raises(CacheStateError, match=shared):
            cache.begin_step([(0, 0, 1), (1, 0, 1)])
