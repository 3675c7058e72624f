"""The plan contract on a hybrid pool: a cache built from numbers alone (CacheConfig, geometry,
group ids, pool pages, layer kinds) replays the extent-op plans an Engine recorded for Gemma 3
(5 windowed layers : 1 full, window 8) under recompute preemption, and after every plan holds
the same mappings, bytes, mapped extents and pool pages mapped as the original; every plan
survives pickling through a loader that admits only plan types."""
from __future__ import annotations

import pickle

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.scheduler.plan import MapExtent, UnmapExtent

from ..hf.test_window_models import prompts
from ..hf.window_families import build
from .test_plan_contract import fresh_executor, memory, record, replay, roundtrip

KiB = 1024


def hybrid_memory(cache) -> dict:
    state = memory(cache)
    state["mapped_pool_pages"] = cache.mapped_pool_pages    # memory() has the mapped extents
    return state


def test_a_fresh_hybrid_pool_replays_recorded_part_plans_into_the_same_memory():
    plans, writes, snapshots = [], [], []
    engine = Engine(build("gemma3"), max_batch=4, max_context=128, cache="vmem", layout="per-layer",
                    page_bytes=4 * KiB, cache_bytes=54 * 4 * KiB, preemption="recompute",
                    max_tokens_per_step=16)
    record(engine, plans, writes, snapshots, hybrid_memory)
    engine.generate(prompts(4, 12, 24, seed=6), SamplingParams(max_new_tokens=80, ignore_eos=True))
    preempted = engine.last_stats.num_preemptions
    replica = fresh_executor(engine.kv.cache)
    engine.close()
    ops = [op for blob in plans for op in roundtrip(pickle.loads(blob)).ops]
    assert preempted > 0
    window = [op for op in ops if isinstance(op, UnmapExtent) and op.kind == "window-8"]
    assert window                            # the window kind given back behind the window
    assert any(isinstance(op, MapExtent) and op.kind == "window-8"     # and mapped anew after
               for op in ops[ops.index(window[0]):])
    with replica:
        assert replica.pool_pages == 54
        replay(replica, plans, writes, snapshots, hybrid_memory)
