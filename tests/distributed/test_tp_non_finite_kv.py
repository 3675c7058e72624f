"""A request whose forward writes NaN K/V into an 8-bit cache under tensor parallelism (gloo, 2
ranks on the CPU) ends "failed" alone, as on one process; every rank stays alive and in step.

It took the engine down: the rank whose encode refused the NaN raised inside the forward while
the other was about to sum activations with it, so a follower's process exited (or rank 1 waited
in the layer's all_reduce until tp_timeout_s when only rank 0's head was NaN), the next call
raised TensorParallelError and every request ended "aborted"; the failed step's first-write
scales (layer 0's V 1339.86 instead of 0.027) were kept on every rank. Now each rank records
non-finite K/V, stores zeros, finishes the forward's collectives, and the ranks agree on it
(one all_reduce): all raise NonFiniteKVError together and unfix what the step fixed, and the
engine re-runs the step's sequences one at a time on every rank, failing the one that fails
alone. A forward that raises anything else on rank 0 closes the engine (TensorParallelError).

The NaN comes from poison tokens in the bad requests' prompts (tests/kv_fault_injection.py: an
overflow in the model); their hooks travel with the pickled model to every rank and hook each
rank's own v_proj shard, so a fault in one KV head is in that head's rank only.
"""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.errors import TensorParallelError
from vmemkv.runtime.models import build_model

from ..engine.test_kv_scales_failed_request import HUGE_THEN_NAN, PLAIN, PROMPTS
from ..kv_fault_injection import NAN, POISON, VFault, poison_v


BAD_PROMPT = [20, 21, 22, 23, 24, 25, 26]
FAULTS = {"huge_then_nan": (POISON, HUGE_THEN_NAN),         # name: (poison token, its V faults)
          "nan_rank0": (POISON - 1, (VFault(layer=1, factor=NAN, kv_heads=(0,)),)),   # layer 1's
          "nan_rank1": (POISON - 2, (VFault(layer=1, factor=NAN, kv_heads=(1,)),))}   # V, 1 head


def test_nan_kv_under_tp_fails_its_request_alone_and_keeps_every_rank_in_step():
    model = poison_v(build_model("tiny-llama", seed=0), dict(FAULTS.values()))
    options = dict(cache="vmem", max_batch=4, max_context=64, kv_cache_dtype="int8")
    with Engine(model, **options) as reference:       # the plain requests alone, in order
        want = [reference.generate([p], PLAIN)[0].outputs[0].token_ids for p in PROMPTS]
        want_k, want_v = (t.clone() for t in (reference.kv.cache.kv_scales.k,
                                              reference.kv.cache.kv_scales.v))
    with Engine(model, tensor_parallel_size=2, tp_timeout_s=60, **options) as engine:
        pids = engine.tp.rank_pids
        for prompt, (fault, (poison, _)), want_tokens in zip(PROMPTS, FAULTS.items(), want):
            bad, good = engine.generate([BAD_PROMPT + [poison], prompt], PLAIN)
            assert bad.status == "failed" and bad.error.type == "NonFiniteKVError", fault
            assert "holds NaN" in bad.error.message
            assert good.status == "finished" and good.outputs[0].token_ids == want_tokens, fault
        states = engine.tp.memory_states()             # both ranks answer: alive, in step
        assert engine.tp.rank_pids == pids and not engine.closed
        manager = engine.kv.manager                    # nothing live; every rank maps what
        engine.kv.check_integrity()                    # rank 0's manager maps, no more
        assert manager.stats().live_tokens == 0 and not engine.has_unfinished()
        truth = {slot: manager.mapped_extents(slot) for slot in range(4)}
        for rank, state in enumerate(states):
            assert state["mapped_extents"] == truth, rank
            assert state["placements"] == states[0]["placements"], rank
            assert state["mapped_pool_pages"] == states[0]["mapped_pool_pages"], rank
            assert state["swapped_bytes"] == 0 and state["swapped_tokens"] == {}, rank
            scales = state["kv_scales"]                # rank r: KV head r's column, the
            assert scales["unsettled"] == [] and scales["fixed"] == [True, True]   # plain's
            assert torch.allclose(torch.tensor(scales["k"]), want_k[:, rank:rank + 1], rtol=1e-4)
            assert torch.allclose(torch.tensor(scales["v"]), want_v[:, rank:rank + 1], rtol=1e-4)
        assert max(max(row) for row in states[0]["kv_scales"]["v"]) < 0.1   # not B's 1339.86

        # any other exception in a forward leaves the other ranks inside the step's
        # collectives: the engine closes at once, typed, instead of believing them in step
        def broken(*args, **kwargs):
            raise RuntimeError("a bug in rank 0's forward")
        engine.tp.executor.runner._run_model = broken
        request = engine.add_request(PROMPTS[1], PLAIN)
        with pytest.raises(TensorParallelError, match="RuntimeError: a bug in rank 0's forward"):
            engine.step()
        assert engine.closed and engine.status(request) == "failed"   # not a user's "aborted"
        assert engine.output(request).error.type == "TensorParallelError"


def test_a_deferring_scale_table_stores_zeros_and_keeps_the_first_message():
    """A rank's table (defer_non_finite) raises nothing inside the forward: it stores 0 for the
    non-finite elements, fixes the layer from the finite rest (unsettled: the agreement unfixes
    it) and keeps the first message for the agreement."""
    from vmemkv.runtime.kv_dtype import ScaleTable, kv_encoding
    table = ScaleTable(kv_encoding("int8", torch.float32), 2, 1, torch.device("cpu"))
    table.defer_non_finite = True
    k = torch.tensor([[[1.27, float("nan")]]])               # [tokens, kv_heads, head_dim]
    v = torch.tensor([[[float("inf"), -2.54]]])
    stored_k, stored_v = table.encode(1, k, v)
    assert stored_k.tolist() == [[[127, 0]]] and stored_v.tolist() == [[[0, -127]]]
    assert table.non_finite.startswith("layer 1's K holds NaN") and table.unsettled == [1]
    table.encode(0, v, k)
    assert table.non_finite.startswith("layer 1's K holds NaN")   # the first one's
    assert table.unfix_unsettled() == [1, 0] and table.fixed == [False, False]
