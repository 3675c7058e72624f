"""A failed op names the request it served: every op a manager plans carries ``owner`` (the seq
id it serves, None for reclaiming), and the engine blames a failed plan on
``ops[op_index].owner`` without reading the manager back. For each op kind that serves a
sequence, a persistent fault on that sequence's ops of that kind ends its request "failed"
after ``max_plan_retries + 1`` failed steps, alone, while the blame reads none of the manager's
tables (they raise while the failed step is being blamed)."""
from __future__ import annotations

import pickle

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.scheduler.plan import (CopyBlock, CopyExtent, DropSwapped, MapExtent, SwapIn, SwapOut,
                                   UnmapExtent)

from .conftest import model, prompts
from .test_engine_straddling_pages import _model as straddling_model

KiB = 1024
RETRIES = 1
TABLE_READS = ("slot_of", "block_table", "mapped_pages", "num_tokens")
SERVING = (MapExtent, CopyExtent, CopyBlock, SwapOut, SwapIn)   # always name their sequence

SMALL_VMEM = dict(cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64)
TIGHT_SWAP = dict(SMALL_VMEM, cache_bytes=3 * 16 * KiB, preemption="swap", swap_bytes=1 << 20)
# kind -> (model, engine options, samples of the first request: n = 2 forks share a partial
# unit, which the first writer copies)
CASES = {
    "MapExtent": (model, SMALL_VMEM, 1),
    "CopyExtent": (model, SMALL_VMEM, 2),
    "MapExtent:bytes": (lambda: straddling_model("head_dim-96"), dict(SMALL_VMEM, max_context=128), 1),
    "CopyBlock": (model, dict(cache="paged", block_size=4, max_batch=4, max_context=64), 2),
    "SwapOut": (model, TIGHT_SWAP, 1),
    "SwapIn": (model, TIGHT_SWAP, 1),
}
KINDS = {"MapExtent": MapExtent, "CopyExtent": CopyExtent, "MapExtent:bytes": MapExtent,
         "CopyBlock": CopyBlock, "SwapOut": SwapOut, "SwapIn": SwapIn}


class OwnerFault:
    """Installed as the cache's ``execute``: a plan holding an op of ``kind`` owned by the
    victim (the owner of the first such op seen) fails there, undone (nothing was applied), and
    the manager's table reads raise until the engine rolls the step back."""

    def __init__(self, engine, kind) -> None:
        self.engine, self.kind, self.victim, self.failures, self.blaming = engine, kind, None, 0, False
        self.execute = engine.kv.cache.execute
        manager = engine.kv.manager
        for name in TABLE_READS:
            if hasattr(manager, name):
                setattr(manager, name, self._guarded(getattr(manager, name), name))
        rollback = engine._txn.rollback

        def rolled_back():
            self.blaming = False
            return rollback()
        engine._txn.rollback = rolled_back
        engine.kv.cache.execute = self

    def _guarded(self, read, name):
        def guarded(*args, **kwargs):
            assert not self.blaming, f"blame read the manager's {name}"
            return read(*args, **kwargs)
        return guarded

    def __call__(self, ops) -> None:
        for op in ops:
            if isinstance(op, SERVING):
                assert op.owner is not None, f"{op} names no sequence"
        for index, op in enumerate(ops):
            if isinstance(op, self.kind) and op.owner is not None:
                if self.victim is None:
                    self.victim = op.owner
                if op.owner == self.victim:
                    self.failures += 1
                    self.blaming = True
                    raise PlanExecutionError(f"injected fault at {op}", op_index=index,
                                             rolled_back=True)
        self.execute(ops)


@pytest.mark.parametrize("kind", list(CASES))
def test_a_persistent_fault_on_an_op_ends_its_owners_request_alone_without_reading_the_manager(kind):
    build, options, n = CASES[kind]
    batch = [p[:21] for p in prompts(3, 21, 30, seed=31)]   # 21: a partial last unit to copy
    with Engine(build(), max_plan_retries=RETRIES, self_check=False, check_integrity=True,
                **options) as engine:
        fault = OwnerFault(engine, KINDS[kind])
        rids = [engine.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                     n=n if i == 0 else 1))
                for i, p in enumerate(batch)]
        engine.run_until_done()                          # no error reaches the caller
        owner_of = {s: rid for rid in rids for s in engine._requests[rid].seq_ids}
        out = [engine.output(rid, pop=True) for rid in rids]
        assert fault.victim is not None and engine.plan_failures == fault.failures == RETRIES + 1
        engine.kv.check_integrity()
        assert engine.kv.manager.stats().live_tokens == 0
    victim = rids.index(owner_of[fault.victim])
    assert out[victim].status == "failed" and out[victim].error.type == "PlanExecutionError"
    assert f"injected fault at {kind.split(':')[0]}(" in out[victim].error.message
    others = [o for i, o in enumerate(out) if i != victim]
    assert [o.status for o in others] == ["finished"] * len(others)
    assert all(len(c.token_ids) == 24 for o in others for c in o.outputs)


def test_reclaiming_ops_name_nobody_and_owners_survive_pickling_without_changing_equality():
    ops = [MapExtent(1, 2, "full", (3, 4), owner=7), CopyExtent(0, 1, 2, 3, "full", owner=8),
           MapExtent(4, 2, "full", (5, 6), 1, owner=9),
           CopyBlock(5, 6, owner=10), SwapOut(11, 30, slot=1), SwapIn(12, 30, blocks=(1, 2)),
           DropSwapped(13), UnmapExtent(1, 2, "full")]
    back = pickle.loads(pickle.dumps(ops))
    assert [op.owner for op in back] == [7, 8, 9, 10, 11, 12, 13, None]
    assert back == ops and MapExtent(1, 2, "full", (3,), owner=7) == MapExtent(1, 2, "full", (3,))
    # a reclaiming op's owner is a class constant: its pickle is as before
    assert b"owner" not in pickle.dumps(UnmapExtent(1, 2, "full"))


def test_a_request_failed_while_swapped_out_leaves_nothing_in_the_prefix_cache():
    """A request ended "failed" while its sequence is swapped out (its SwapIn keeps failing) is
    unpublished as a resident one is (ending.py): the same prompt later finds none of its units
    (its swapped-out units stay cached until then)."""
    batch = [p[:21] for p in prompts(3, 21, 30, seed=31)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with Engine(model(), max_plan_retries=RETRIES, self_check=False, prefix_sharing=True,
                **TIGHT_SWAP) as engine:
        fault = OwnerFault(engine, SwapIn)
        rids = [engine.add_request(p, params) for p in batch]
        owner_of = {s: rid for rid in rids for s in engine._requests[rid].seq_ids}
        while fault.victim is None or engine.status(owner_of[fault.victim]) != "failed":
            try:
                engine.step()
            except PlanExecutionError:   # a failed step, raised until its request is failed
                pass
        victim = rids.index(owner_of[fault.victim])
        for rid in rids:          # the others end now: nothing they free evicts the failed one's
            if engine.status(rid) not in ("failed", "finished"):
                engine.abort(rid)
        engine.kv.cache.execute = fault.execute            # the fault is gone
        hits = engine.kv.manager.prefix_hits
        again = engine.generate([batch[victim]], params)[0]
        assert engine.kv.manager.prefix_hits == hits       # nothing of the failed one is found
    assert again.status == "finished" and len(again.outputs[0].token_ids) == 24
