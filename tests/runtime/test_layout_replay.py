"""The executor-replay property: a cache built from ``manager.layout()`` alone (pickled, as a
tensor-parallel rank or another process receives it) and driven by the recorded plans
(pickled StepPlans and the K/V each step wrote) holds exactly what the original cache holds,
on every cache kind. A layout missing what the cache needs makes the replay fail."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.distributed.worker import memory_state
from vmemkv.runtime.errors import CacheConfigError, CacheStateError
from vmemkv.runtime.kv import cache_from_layout, check_matches
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.layout import CacheKind, PoolBacking
from vmemkv.scheduler.plan import ScheduledSeq, StepPlan

from .harness import ShadowRun

KiB = 1024
PLAIN = dict(num_layers=2, num_kv_heads=2, head_dim=16, max_context=64)     # 128 B a layer-token
STRADDLING = dict(num_layers=2, num_kv_heads=3, head_dim=16, max_context=128)   # 192 B: k = 3
HYBRID = dict(num_layers=3, num_kv_heads=2, head_dim=16, max_context=128,
              layer_windows=(8, None, 8))                    # layers 0, 2 windowed, 1 full

VMEM_OPS = {"MapExtent", "UnmapExtent", "CopyExtent", "SwapOut", "SwapIn"}
PAGED_OPS = {"CopyBlock", "SwapOut", "SwapIn"}


@dataclasses.dataclass(frozen=True)
class Kind:
    fields: dict          # CacheConfig fields
    cache: str            # make_kv's kind
    options: dict         # make_kv's options
    backing: object       # the pool backing the layout declares (vmem), None (paged)
    seed: int             # a workload whose plans carry every op in ``ops``
    room: float           # cache_bytes, in full-length sequences
    ops: set              # op types the recorded plans carry


PAGE = dict(layout="per-layer", page_bytes=4 * KiB)
KINDS = {
    "vmem-per-layer": Kind(PLAIN, "vmem", PAGE, PoolBacking.WHOLE, 1, 2.5, VMEM_OPS),
    "vmem-interleaved": Kind(PLAIN, "vmem", dict(PAGE, layout="interleaved"), PoolBacking.WHOLE,
                             0, 2.5, VMEM_OPS),
    "vmem-byte-mapped": Kind(STRADDLING, "vmem", PAGE, PoolBacking.BYTES, 0, 1.2,
                             VMEM_OPS),
    "vmem-hybrid-window": Kind(HYBRID, "vmem", PAGE, PoolBacking.WHOLE, 0, 1.2,
                               VMEM_OPS),
    "paged": Kind(PLAIN, "paged", dict(block_size=8), None, 0, 2.5, PAGED_OPS),
    "paged-hybrid": Kind(HYBRID, "paged", dict(block_size=16), None, 6, 2.5, PAGED_OPS),
}


class Recorder:
    """Stands in for a cache: forwards every call to it and records what an executor is sent,
    as pickled (StepPlan, writes) pairs: ops, then table edits, then the step's sequences, and
    the K/V the model wrote in that step (``writes``: (layer, k, v))."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.plans: list = []

    def _plan(self, fresh: bool):
        if fresh or not self.plans or self.plans[-1][0].seqs:
            self.plans.append((StepPlan(seqs=[], ops=[]), []))
        return self.plans[-1]

    def execute(self, ops) -> None:
        self._plan(True)[0].ops.extend(ops)
        self.cache.execute(ops)

    def apply_tables(self, edits) -> None:
        self._plan(False)[0].tables.extend(edits)
        self.cache.apply_tables(edits)

    def begin_step(self, seqs):
        self._plan(False)[0].seqs.extend(ScheduledSeq(s, c, n, None, False) for s, c, n in seqs)
        return self.cache.begin_step(seqs)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.plans[-1][1].append((layer, k.clone(), v.clone()))
        self.cache.write(layer, k, v)

    def pickled(self) -> list:
        return [pickle.dumps(plan) for plan in self.plans]

    def __getattr__(self, name: str):
        return getattr(self.cache, name)


class WindowedRun(ShadowRun):
    """ShadowRun that also gives back memory behind the window before each growth (hybrid
    pools emit UnmapExtent of their window kind); windowed layers then no longer hold every token, so contents are
    compared against the replay rather than against the truth."""

    def grow(self, seq_id: int) -> None:
        self.manager.release_behind_window(seq_id, len(self.tokens[seq_id]))
        super().grow(seq_id)

    def check_contents(self) -> None:
        pass


def recorded_run(kind_id: str, steps: int = 40):
    kind = KINDS[kind_id]
    config = CacheConfig(dtype=torch.float32, max_batch=4, **kind.fields)
    run_cls = WindowedRun if config.layer_windows else ShadowRun
    # room for ``kind.room`` full-length sequences, swap for 2: preemption, swaps, reclamation
    run = run_cls(config, kind.cache, kind.seed, backends=(), num_heads=2 * config.num_kv_heads,
                  swap_bytes=2 * config.max_context * config.bytes_per_token,
                  cache_bytes=int(kind.room * config.max_context * config.bytes_per_token),
                  **kind.options)
    run.cache.cache = recorder = Recorder(run.cache.cache)
    run.run(steps)
    return run, recorder, run.manager.layout()


def replay(layout, config: CacheConfig, plans: list):
    """A cache built from ``layout`` alone, after every pickled plan and its writes."""
    cache = cache_from_layout(pickle.loads(pickle.dumps(layout)), config)
    try:
        for blob in plans:
            plan, writes = pickle.loads(blob)
            cache.execute(plan.ops)
            cache.apply_tables(plan.tables)
            if plan.seqs:
                cache.begin_step([(s.seq_id, s.num_computed_tokens, s.num_new_tokens) for s in plan.seqs])
            for layer, k, v in writes:
                cache.write(layer, k, v)
    except BaseException:
        cache.close()
        raise
    return cache


def memory(cache) -> dict:
    """What the cache holds: placements, swap space, mapped parts and bound pages
    (``memory_state``, as tensor-parallel ranks compare), and the bytes: every mapped page of
    the range (vmem: range page -> pool page id, and its bytes) or the whole block pool."""
    state = memory_state(cache)
    if cache.kind is CacheKind.VMEM:
        cache.wait_for_plan()
        pb = cache.page_bytes
        state["range"] = cache.range.mapped_pages()
        state["bytes"] = {pi: cache.range.tensor(pi * pb, pb).clone().view(torch.uint8)
                          for pi in state["range"]}
    else:
        state["bytes"] = {0: cache.pools.view(torch.uint8).clone()}
    return state


def same_memory(a: dict, b: dict) -> bool:
    return (a.keys() == b.keys() and all(a[k] == b[k] for k in a if k != "bytes")
            and a["bytes"].keys() == b["bytes"].keys()
            and all(torch.equal(a["bytes"][p], b["bytes"][p]) for p in a["bytes"]))


@pytest.mark.parametrize("kind_id", list(KINDS))
def test_a_cache_built_from_the_pickled_layout_alone_replays_to_the_same_memory(kind_id):
    run, recorder, layout = recorded_run(kind_id)
    original = recorder.cache
    try:
        kind = KINDS[kind_id]
        assert layout.kind is CacheKind(kind.cache)
        if layout.kind is CacheKind.VMEM:
            assert layout.backing is kind.backing
        ops = {type(op).__name__ for blob in recorder.pickled() for op in pickle.loads(blob)[0].ops}
        assert ops == kind.ops                      # the workload reached every op of its kind
        assert run.events["decode"] > 50 and run.events["fork"] > 0
        replayed = replay(layout, run.config, recorder.pickled())
        try:
            check_matches(run.manager, replayed)     # the original manager's tables, exactly
            assert same_memory(memory(replayed), memory(original))
            assert memory(original)["placements"], "nothing live to compare"
        finally:
            replayed.close()
    finally:
        original.close()


# what each cache needs from its layout, dropped: most of the pool (ops name pool pages the
# cache lacks), the layer kinds (ops name a kind the cache lacks), or most of the blocks
# (paged: a block table names blocks the pool lacks)
LACKING = {
    "vmem-byte-mapped": dict(pool_pages=6),
    "vmem-hybrid-window": dict(kinds=(("full", (0, 1, 2)),)),
    "paged": dict(num_blocks=2),
}


@pytest.mark.parametrize("kind_id", list(LACKING))
def test_a_layout_missing_what_the_cache_needs_fails_the_replay(kind_id):
    run, recorder, layout = recorded_run(kind_id)
    try:
        with pytest.raises(CacheStateError):   # refused by name, before it runs
            replay(dataclasses.replace(layout, **LACKING[kind_id]), run.config, recorder.pickled())
    finally:
        recorder.cache.close()


def test_a_layout_is_plain_frozen_data():
    _, recorder, layout = recorded_run("vmem-hybrid-window", steps=1)
    recorder.cache.close()
    assert pickle.loads(pickle.dumps(layout)) == layout
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.pool_pages = 1


def test_a_layout_that_cannot_build_a_cache_is_refused_by_name():
    _, recorder, layout = recorded_run("vmem-byte-mapped", steps=1)
    config = recorder.cache.config
    recorder.cache.close()
    with pytest.raises(CacheConfigError, match="built from a CacheLayout"):
        cache_from_layout("vmem", config)
    with pytest.raises(ConfigError, match="CacheLayout pool_pages must be an int >= 1, got None"):
        dataclasses.replace(layout, pool_pages=None)
    with pytest.raises(ConfigError, match="kinds must cover every layer"):
        dataclasses.replace(layout, kinds=(("full", (0,)),))
    with pytest.raises(ConfigError, match="a whole pool needs pages that hold whole tokens"):
        dataclasses.replace(layout, backing=PoolBacking.WHOLE)
    with pytest.raises(ConfigError, match="CacheLayout num_slots must be an int >= 1, got 0"):
        dataclasses.replace(layout, num_slots=0)
    with pytest.raises(CacheConfigError, match="4 slots but CacheConfig.max_batch is 3"):
        cache_from_layout(layout, dataclasses.replace(config, max_batch=3))
