"""A plan that fails part-way is undone by the cache and rolled back by the manager.

For one step whose plan holds every kind of op (unmap, map, copy-on-write copy, swap out, swap
in, reclaim), a fault is injected at EVERY call index of every driver primitive in turn: each
failure raises PlanExecutionError, leaves manager tables, mappings, pool counts, swap space and
every sequence's contents exactly as before, and the same step retried then succeeds.
"""
import os

import pytest
import torch

from vmemkv.runtime.cache.paged_cache import PagedKVCache
from vmemkv.runtime.kv import make_kv
from tests.runtime.run_plan import run_plan
from vmemkv.runtime.errors import MapperPlanError, PlanExecutionError
from vmemkv.scheduler.errors import OutOfCapacityError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.managers.common import TransactionStateError
from vmemkv.scheduler.plan import CopyBlock
from vmemkv.vmem import DriverCallError
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from .. import process_resources
from .model import CacheModel, canon, small_config

VMEM = ["vmem-per-layer", "vmem-interleaved", "vmem-per-layer-mapper", "vmem-interleaved-mapper"]
EVERY_OP = {"UnmapExtent", "MapExtent", "CopyExtent", "SwapOut", "SwapIn"}


def scenario(layout: str) -> CacheModel:
    """Sequences 0 (43 tokens), its fork 2 sharing a partial last page, 1 swapped out, and a
    freed sequence whose pages are still mapped (reclaimable)."""
    m = CacheModel(layout)
    m.step(m.admit(list(range(7)) * 6 + [1]))
    m.step(m.admit([1] * 10))
    m.step(m.fork(0))
    m.step(m.preempt(1, swap=True))
    m.step(m.admit([2] * 12))
    m.step(m.free(3))
    m.check()
    return m


def big_step(m: CacheModel):
    """One step: copy-on-write append, a swap out, a swap in and an admission that reclaims."""
    mgr = m.manager

    def mutate():
        mgr.append(2, 1, token_ids=[3])
        mgr.swap_out(0)
        mgr.swap_in(1)
        mgr.allocate(9, 30, token_ids=[4] * 30)
        return [type(op).__name__ for op in mgr._ops]
    return mutate


def after_big_step(m: CacheModel, ops) -> None:
    m.tokens[2] = m.tokens[2] + [3]
    m.swapped[0] = m.tokens.pop(0)
    m.tokens[1] = m.swapped.pop(1)
    m.tokens[9] = [4] * 30
    m.write([(9, 0, 30), (2, 43, 1)])


@pytest.mark.parametrize("layout", VMEM)
@pytest.mark.parametrize("kind", ["map", "unmap", "copy"])
def test_fault_at_every_call_index_rolls_back_and_retry_succeeds(layout, kind):
    m = scenario(layout)
    before = m.snapshot()
    failures = 0
    while True:
        calls_before = m.driver.calls[kind]
        m.driver.fail_at(kind, failures)
        try:
            ops = run_plan(m.manager, m.cache, big_step(m))
        except PlanExecutionError as error:
            if "mapper" in layout:
                assert isinstance(error, MapperPlanError)
            assert error.rolled_back and f"{kind}: injected fault" in str(error)
            assert isinstance(error.__cause__.__cause__ if "mapper" in layout else error.__cause__,
                              DriverCallError)
            assert not m.manager.in_transaction
            assert m.snapshot() == before, f"state changed after a fault at {kind} call {failures}"
            m.check()
            failures += 1
            continue
        finally:
            m.driver.disarm()
        break
    assert EVERY_OP <= set(ops), ops
    assert m.driver.calls[kind] - calls_before == failures   # every call index was failed once
    assert failures >= 2, f"the plan made only {failures} {kind} calls"
    after_big_step(m, ops)
    m.check()
    # the retried step did everything: memory now differs from before, and matches the tables
    assert m.snapshot() != before
    m.close()


@pytest.mark.parametrize("layout", ["vmem-per-layer", "paged"])
def test_failure_after_each_op_of_a_plan_is_undone(layout, monkeypatch):
    """Fail right AFTER op k was applied (so its own effects must be undone too)."""
    m = scenario(layout)
    before = m.snapshot()
    apply_name = "_apply" if layout == "paged" else "_apply_layer_group"
    k = 0
    while True:
        calls = {"n": 0}
        executor = type(m.cache.cache)     # the KVCache behind the manager + cache pair
        original = getattr(executor, apply_name)

        if layout == "paged":
            def failing(self, op, buffer, journal, _k=k):
                original(self, op, buffer, journal)
                calls["n"] += 1
                if calls["n"] == _k + 1:
                    raise MemoryError(f"injected OOM after op {_k}")
        else:
            def failing(self, bound, group, journal=None, _k=k):
                original(self, bound[:_k + 1], group, journal)
                if _k + 1 < len(bound):
                    raise MemoryError(f"injected OOM after op {_k}")
                original(self, bound[_k + 1:], group, journal)
        monkeypatch.setattr(executor, apply_name, failing)
        try:
            ops = run_plan(m.manager, m.cache, big_step(m))
        except PlanExecutionError as error:
            assert error.rolled_back and isinstance(error.__cause__, MemoryError)
            assert m.snapshot() == before
            m.check()
            k += 1
            continue
        finally:
            monkeypatch.undo()
        break
    assert k == len(ops) - (0 if layout == "paged" else 1)   # a failure after every op but the last
    after_big_step(m, ops)
    m.check()
    m.close()


def test_a_failed_plan_gives_a_copy_on_write_destination_its_bytes_back(monkeypatch):
    """PagedKVCache.execute is all or nothing: a plan [CopyBlock(0, 1), an op that fails] leaves
    block 1 (overwritten by the copy) with its own bytes again, and every other block as it was."""
    cache = PagedKVCache(small_config(), block_size=8, num_blocks=4)
    cache.pools.copy_(torch.arange(cache.pools.numel()).reshape(cache.pools.shape))  # all differ
    before = cache.pools.clone()
    original, applied = PagedKVCache._apply, []

    def fail_second_op(self, op, buffer, journal):
        if applied:
            raise MemoryError("injected OOM at op 1")
        original(self, op, buffer, journal)
        applied.append(op)
    monkeypatch.setattr(PagedKVCache, "_apply", fail_second_op)
    with pytest.raises(PlanExecutionError) as info:
        cache.execute([CopyBlock(0, 1), CopyBlock(2, 3)])
    assert info.value.rolled_back and applied == [CopyBlock(0, 1)]
    assert torch.equal(cache.pools, before)
    monkeypatch.undo()
    cache.execute([CopyBlock(0, 1)])                  # the cache is usable: the copy happens
    assert torch.equal(cache.pools[:, :, 1], before[:, :, 0])


def test_manager_error_inside_the_unit_rolls_back_earlier_calls():
    m = scenario("vmem-per-layer")
    before = m.snapshot()

    def mutate():
        m.manager.append(2, 1, token_ids=[3])          # succeeds (copy-on-write)
        for seq_id in range(10, 20):                    # the first succeed, then no room
            m.manager.allocate(seq_id, 40)
    with pytest.raises(OutOfCapacityError):
        run_plan(m.manager, m.cache, mutate)
    assert m.snapshot() == before
    assert m.manager.take_ops() == []
    m.check()
    m.close()


def test_transaction_api_contract():
    model = small_config().model_spec()
    mgr = make_manager("paged", model, 10**6, 64, block_size_tokens=8, swap_bytes=10**5)
    mgr.allocate(1, 20, token_ids=list(range(20)))
    state = canon(vars(mgr))
    mgr.begin()
    assert mgr.in_transaction
    with pytest.raises(TransactionStateError, match="inside an open transaction"):
        mgr.begin()
    mgr.append(1, 5)
    mgr.fork(1, 2)
    mgr.swap_out(2)
    mgr.allocate(3, 9, token_ids=list(range(9)))
    mgr.rollback()
    assert canon(vars(mgr)) == state and not mgr.in_transaction
    mgr.check_integrity()
    for call in (mgr.commit, mgr.rollback):
        with pytest.raises(TransactionStateError, match="without begin"):
            call()
    mgr.begin()
    mgr.append(1, 5)
    mgr.commit()
    assert mgr.num_tokens(1) == 25
    mgr.check_integrity()


@pytest.mark.parametrize("policy", ["reserve-max", "reserve-oracle", "paged", "vmem"])
def test_every_policy_rolls_back(policy):
    model = small_config().model_spec()
    mgr = make_manager(policy, model, 64 * 512 * 4, 64, block_size_tokens=8, page_bytes=4096,
                       swap_bytes=64 * 512 * 2)
    mgr.allocate(1, 20, final_tokens=40)
    state = canon(vars(mgr))
    mgr.begin()
    mgr.append(1, 3)
    mgr.allocate(2, 5, final_tokens=9)
    mgr.swap_out(1)
    mgr.free(2)
    mgr.rollback()
    assert canon(vars(mgr)) == state
    mgr.check_integrity()


@pytest.mark.parametrize("mapper", [False, True])
@pytest.mark.parametrize("fail", ["create_pages", "reserve"])
def test_out_of_memory_while_building_the_pool_leaves_nothing_allocated(fail, mapper):
    config = small_config()
    driver = FaultInjectingDriver(HostDriver())
    make_kv(config, "vmem", page_bytes=4096, driver=driver).close()   # warm caches, imports
    with process_resources.watch() as watch:
        start = watch.snapshot()
        driver.fail_at(fail, 0, out_of_memory=True)
        with pytest.raises(DriverCallError, match="out of memory"):
            make_kv(config, "vmem", page_bytes=4096, driver=driver, background_mapper=mapper)
        assert watch.snapshot() == start
        assert driver.mapped_addresses == 0
        cache = make_kv(config, "vmem", page_bytes=4096, driver=driver)  # the next try works
        assert watch.snapshot().live_reservations == 1
        cache.close()
        assert watch.snapshot() == start


def test_undo_that_fails_marks_the_cache_unusable():
    m = scenario("vmem-per-layer")
    # the plan starts with an unmap; its second map fails, and every later map too, so the
    # undo (which maps the unmapped page back) fails as well
    m.driver.fail_at("map", 1, persistent=True)
    with pytest.raises(PlanExecutionError) as info:
        run_plan(m.manager, m.cache, big_step(m))
    assert not info.value.rolled_back and "close this cache" in str(info.value)
    with pytest.raises(Exception, match="cache unusable"):
        m.cache.execute([])
    m.driver.disarm()
    m.cache._broken = None      # let close() release what it can
    m.close()


def test_an_interrupt_whose_undo_fails_marks_the_cache_unusable(monkeypatch):
    """As above with a KeyboardInterrupt at the second map: the interrupt goes on, and a cache
    whose undo failed refuses every later call rather than run over memory it got wrong."""
    m = scenario("vmem-per-layer")
    real_map, maps = m.driver.map, []

    def interrupted_map(address, handle, page_bytes):
        maps.append(address)
        if len(maps) == 2:
            raise KeyboardInterrupt
        if len(maps) > 2:
            raise DriverCallError("map: injected fault (the undo's)")
        real_map(address, handle, page_bytes)

    monkeypatch.setattr(m.driver, "map", interrupted_map)
    with pytest.raises(KeyboardInterrupt):
        run_plan(m.manager, m.cache, big_step(m))
    with pytest.raises(Exception, match="cache unusable"):
        m.cache.execute([])
    monkeypatch.undo()
    m.cache._broken = None      # let close() release what it can
    m.close()

@pytest.mark.parametrize("policy,layout", [("paged", "per-layer"), ("vmem", "per-layer"),
                                           ("vmem", "interleaved"), ("reserve-max", "per-layer")])
def test_rollback_after_random_calls_restores_the_exact_state(policy, layout):
    """Random manager calls (with token ids, so prefix chains and id lists grow) inside
    transactions: rollback gives back exactly the state at begin, commit keeps the changes."""
    import random
    rng = random.Random(3)
    model = small_config().model_spec()
    mgr = make_manager(policy, model, 6 * 64 * model.bytes_per_token, 64, block_size_tokens=8,
                       page_bytes=4096 if layout == "per-layer" else 8192, layout=layout,
                       max_slots=4 if policy == "vmem" else None, swap_bytes=64 * model.bytes_per_token)
    live, next_id = [], 0

    def random_call():
        nonlocal next_id
        roll = rng.random()
        ids = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
        if (roll < 0.3 or not live) and mgr.can_allocate(len(ids), ids, final_tokens=64):
            mgr.allocate(next_id, len(ids), token_ids=ids, final_tokens=64)
            live.append(next_id)
            next_id += 1
        elif roll < 0.6 and live:
            s = rng.choice(live)
            if mgr.can_append(s, 3):
                mgr.append(s, 3, token_ids=[rng.randrange(3) for _ in range(3)])
        elif roll < 0.7 and live:
            s = rng.choice(live)
            if mgr.can_fork(s):
                mgr.fork(s, next_id)
                live.append(next_id)
                next_id += 1
        elif roll < 0.8 and live:
            s = rng.choice(live)
            if mgr.can_swap_out(s):
                mgr.swap_out(s)
                if mgr.can_swap_in(s):
                    mgr.swap_in(s)
                else:
                    mgr.free(s)
                    live.remove(s)
        elif live:
            s = rng.choice(live)
            mgr.free(s)
            live.remove(s)

    for _ in range(60):
        state, saved = canon({k: v for k, v in vars(mgr).items() if k != "model"}), (list(live), next_id)
        mgr.begin()
        for _ in range(rng.randint(1, 6)):
            random_call()
        if rng.random() < 0.5:
            mgr.rollback()
            live[:], next_id = saved[0], saved[1]
            assert canon({k: v for k, v in vars(mgr).items() if k != "model"}) == state
        else:
            mgr.commit()
        mgr.check_integrity()
        mgr.take_ops()
