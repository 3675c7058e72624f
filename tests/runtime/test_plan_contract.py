"""The step plan is the whole contract: plans are plain, picklable data, and a cache that never
saw a manager executes a recorded sequence of them into the same memory as the original."""
from __future__ import annotations

import io
import pickle

import pytest
import torch

pytest.importorskip("transformers")

from vmemkv.runtime.cache import PagedKVCache, VMemKVCache  # noqa: E402
from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402
from vmemkv.scheduler.geometry import PageGeometry  # noqa: E402
from vmemkv.scheduler.plan import CopyBlock, CopyExtent, SwapIn, SwapOut  # noqa: E402

from tests.engine.conftest import model, prompts  # noqa: E402
from tests.engine.test_engine_pressure import TIGHT  # noqa: E402

KiB = 1024
# the pressure tests' caches, sized so that one run preempts (recompute and swap), hits shared
# prefixes and copies forked pages on write: 8 groups of 32 / 10 of 16 tokens, 40 blocks of 4
CACHES = {name: dict(TIGHT[name], cache_bytes=size * KiB)
          for name, size in (("vmem-per-layer", 128), ("vmem-interleaved", 80), ("paged", 80))}
SWAP_BYTES = 64 * KiB     # room for two swapped sequences; further preemptions recompute
STEP_TOKENS = 40          # admits the bases before their followers, which then hit them


class PlanOnlyUnpickler(pickle.Unpickler):
    """Refuses every class outside the scheduler's plan types and builtins: a plan that held a
    tensor, a manager or any live object would fail to load."""

    def find_class(self, module, name):
        if module == "builtins" or module.startswith("vmemkv.scheduler.") or module == "collections":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"plan holds {module}.{name}")


def roundtrip(plan):
    return PlanOnlyUnpickler(io.BytesIO(pickle.dumps(plan))).load()


def workload():
    """Shared prefixes (prefix hits), greedy and sampled requests, n = 2 forks."""
    base = prompts(3, 34, 44, seed=11)       # followers share 33 tokens: a whole vmem page
    batch = base + [p[:33] + q for p, q in zip(base, prompts(3, 3, 9, seed=12))]
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, n=2 if i % 2 else 1,
                             temperature=0.0 if i % 3 else 0.8, seed=i) for i in range(len(batch))]
    return batch, params


def run(cache: str, preemption: str, execute_wrapper=None, **extra):
    options = dict(CACHES[cache], preemption=preemption, prefix_sharing=True,
                   swap_bytes=SWAP_BYTES if preemption == "swap" else 0, **extra)
    engine = Engine(model(), max_batch=9, max_context=128, check_integrity=True, seed=3,
                    max_tokens_per_step=STEP_TOKENS, **options)
    if execute_wrapper is not None:
        execute_wrapper(engine)
    batch, params = workload()
    out = engine.generate(batch, params)
    return engine, [[c.token_ids for c in o.outputs] for o in out]


def pickle_every_plan(engine):
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: execute(roundtrip(plan))


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_engine_tokens_identical_when_every_plan_is_pickled(cache, preemption):
    plans = []

    def keep_plans(engine):
        execute = engine.runner.execute
        engine.runner.execute = lambda plan: plans.append(plan) or execute(plan)

    plain, expected = run(cache, preemption, keep_plans)
    stats, prefix_hits = plain.last_stats, plain.kv.manager.prefix_hits
    plain.close()
    assert prefix_hits > 0, "the workload was meant to share prefixes"
    assert any(s.fork_ids for plan in plans for s in plan.seqs), "and to fork n > 1 samples"
    pickled, got = run(cache, preemption, pickle_every_plan)
    pickled.close()
    assert stats.num_preemptions > 0, "the cache was meant to be too small"
    if preemption == "swap":
        assert stats.num_swap_preemptions > 0
    assert got == expected
    assert pickled.last_stats.num_preemptions == stats.num_preemptions


def record(engine, plans: list, writes: list, snapshots=None, state=None) -> None:
    """Record every plan (pickled) and, per plan, the K/V the model wrote, layer by layer, and
    (with ``snapshots``) ``state(cache)`` after the plan ran (default: ``memory``)."""
    execute, cache = engine.runner.execute, engine.kv.cache
    write = cache.write

    def recording_execute(plan):
        plans.append(pickle.dumps(plan))
        writes.append([])
        result = execute(plan)
        if snapshots is not None:
            snapshots.append((state or memory)(cache))
        return result

    def recording_write(layer, k, v):
        writes[-1].append((layer, k.clone(), v.clone()))
        return write(layer, k, v)

    engine.runner.execute = recording_execute
    cache.write = recording_write


def fresh_executor(original):
    """A cache built from numbers alone (the shape, geometry and pool size), no manager."""
    if isinstance(original, VMemKVCache):
        g = original.geometry
        return VMemKVCache(original.config, PageGeometry(g.layout, g.page_bytes, g.num_layers,
                                                         g.layer_bytes_per_token, g.window_layers),
                           original.num_groups, pool_pages=original.pool_pages,
                           kinds=original.kinds)
    return PagedKVCache(original.config, original.block_size, original.num_blocks)


def memory(cache) -> dict:
    """Everything a cache holds: placements, swap copies, and mapped pages' bytes (vmem) or the
    whole block pool (paged)."""
    state = {"placements": {s: cache.placement(s) for s in cache.placed_seq_ids},
             "swapped": {s: cache.swap_buffer(s).clone() for s in cache.swapped_tokens()}}
    if isinstance(cache, VMemKVCache):
        cache.wait_for_plan()
        mapped = cache.range.mapped_pages()
        pb = cache.page_bytes
        state["mapped"] = mapped
        state["bytes"] = {pi: cache.range.tensor(pi * pb, pb).clone() for pi in mapped}
        state["slot_pages"] = [cache.mapped_extents(s) for s in range(cache.config.max_batch)]
    else:
        state["pools"] = cache.pools.clone()
    return state


def replay(replica, plans: list, writes: list, snapshots: list, state=memory) -> None:
    """Execute the recorded plans and writes on ``replica``; after each, ``state(replica)``
    equals the original's snapshot."""
    for blob, step_writes, expected in zip(plans, writes, snapshots):
        plan = pickle.loads(blob)
        replica.execute(plan.ops)
        replica.apply_tables(plan.tables)
        if plan.seqs:
            replica.begin_step([(s.seq_id, s.num_computed_tokens, s.num_new_tokens)
                                for s in plan.seqs])
            for layer, k, v in step_writes:
                replica.write(layer, k, v)
        assert_same(state(replica), expected)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
            assert x.keys() == y.keys(), key
            assert all(torch.equal(x[k], y[k]) for k in x), key
        else:
            assert x == y, key


@pytest.mark.parametrize("cache", list(CACHES))
def test_cache_that_never_saw_a_manager_replays_recorded_plans_into_the_same_memory(cache):
    plans, writes, snapshots = [], [], []
    engine = Engine(model(), max_batch=9, max_context=128, preemption="swap", prefix_sharing=True,
                    swap_bytes=SWAP_BYTES, seed=3, max_tokens_per_step=STEP_TOKENS, **CACHES[cache])
    record(engine, plans, writes, snapshots)
    batch, params = workload()
    engine.generate(batch, params)
    final = memory(engine.kv.cache)
    replica = fresh_executor(engine.kv.cache)
    engine.close()
    ops = [op for blob in plans for op in pickle.loads(blob).ops]
    kinds = {type(op) for op in ops}
    assert {SwapOut, SwapIn} <= kinds, "the run was meant to swap"
    assert CopyExtent in kinds or CopyBlock in kinds, "the run was meant to copy on write"
    assert any(pickle.loads(b).preempted for b in plans)
    assert any(s.fork_ids for b in plans for s in pickle.loads(b).seqs), "forks n > 1"
    with replica:
        replay(replica, plans, writes, snapshots)
        assert_same(memory(replica), final)
