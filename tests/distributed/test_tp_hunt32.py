"""Tensor parallelism (gloo, 2 ranks on the CPU), hunt 32.

An 8-bit KV head that a layer's first write leaves all 0 stays "open" and is fixed by the first
write that reaches it, on its own rank only. A rolled-back step that fixed such a head on a
follower but nothing on rank 0 sent no UnfixUnsettled (rank 0 sent it only when its own journal
named a layer): the follower kept the failed step's scale (layer 0's K 1.40 instead of 0.023)
and the next request generated other tokens than one process ([224, 39, 201, ...] instead of
[187, 139, 190, ...]). Rank 0 now sends it when a forward ran since the engine last kept or
dropped the scales (``TensorParallel.settle_scales``), and never when none ran: a follower's
journal then holds the kept step's, which it settles at its next forward.

``memory_utilization`` is per rank: a fraction too large for the ranks spawned on this host is
refused naming it (it named ``cache_bytes``, which was not given).
"""
from __future__ import annotations

import functools
import multiprocessing

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import CacheTooLargeError
from vmemkv.runtime.models import build_model

HUGE = 200        # a token whose layer-0 K/V in KV head 1 (rank 1's) is ~100x the others'
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def open_heads_model():
    """tiny-llama (2 layers, KV heads 0 and 1: one per rank at tp=2) where token 0 embeds to 0
    (a prompt of 0s writes K = V = 0: every head left open), KV head 0 is always 0 (rank 0's
    heads stay open for good) and ``HUGE`` makes KV head 1's layer-0 K/V huge."""
    model = build_model("tiny-llama", seed=0)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, 0] = 0
        embed[0] = 0
        embed[HUGE] = 0
        embed[HUGE, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight[:16] = 0
            layer.self_attn.v_proj.weight[:16] = 0
        for proj in (model.model.layers[0].self_attn.k_proj, model.model.layers[0].self_attn.v_proj):
            proj.weight[16:, 0] *= 100.0
    return model


def _step_failing_once(engine: Engine, owner, method: str, message: str) -> None:
    """One ``engine.step()`` whose ``owner.method`` raises RuntimeError(message) once (then
    restored); the step must raise it."""
    original = getattr(owner, method)

    def fails_once(*args, **kwargs):
        setattr(owner, method, original)
        raise RuntimeError(message)

    setattr(owner, method, fails_once)
    with pytest.raises(RuntimeError) as raised:
        engine.step()
    assert str(raised.value) == message


def _after_a_rolled_back_step(engine: Engine) -> list:
    """A zero prompt (kept: heads open), then a step whose sampler raises after the forward
    wrote ``HUGE``'s K/V (rolled back; its request aborted), then a plain request's tokens."""
    zero = engine.generate([[0] * 8], SamplingParams(max_new_tokens=1))[0]
    assert zero.status == "finished"
    huge = engine.add_request([5, HUGE, 7, HUGE, 9], SamplingParams(max_new_tokens=4))
    _step_failing_once(engine, engine.sampler, "sample", "the sampler failed")
    assert engine.abort(huge).status == "aborted"
    return engine.generate([[11, 12, 13, 14, 15, 16]], GREEDY)[0].outputs[0].token_ids


def test_a_rolled_back_step_that_fixed_only_a_followers_open_head_reopens_it():
    options = dict(max_batch=2, max_context=64, kv_cache_dtype="int8", self_check=False)
    with Engine(open_heads_model(), **options) as one:
        want = _after_a_rolled_back_step(one)
        want_k, want_v = one.kv.cache.kv_scales.k.tolist(), one.kv.cache.kv_scales.v.tolist()
    assert want == [187, 139, 190, 190, 190, 185, 164, 106]
    with Engine(open_heads_model(), tensor_parallel_size=2, **options) as engine:
        assert _after_a_rolled_back_step(engine) == want
        states = engine.tp.memory_states()
    for rank, state in enumerate(states):           # rank r holds KV head r's column
        scales = state["kv_scales"]
        assert scales["unsettled"] == [] and scales["fixed"] == [True, True], rank
        assert torch.allclose(torch.tensor(scales["k"]),
                              torch.tensor(want_k)[:, rank:rank + 1], rtol=1e-5), rank
        assert torch.allclose(torch.tensor(scales["v"]),
                              torch.tensor(want_v)[:, rank:rank + 1], rtol=1e-5), rank
    assert [row[0] for row in states[0]["kv_scales"]["k"]] == [0.0, 0.0]   # open for good


def _after_a_failure_before_the_forward(engine: Engine) -> list:
    """A prompt's first step (kept: its writes fixed every layer's scales on every rank), then a
    step whose scheduler raises (no forward ran), then the rest of the request."""
    rid = engine.add_request([11, 12, 13, 14, 15, 16], GREEDY)
    engine.step()
    _step_failing_once(engine, engine.scheduler, "schedule", "the scheduler failed")
    engine.run_until_done()
    return engine.output(rid).outputs[0].token_ids


def test_a_step_that_fails_before_its_forward_keeps_every_ranks_kept_scales():
    """The guard of the fix above: a follower settles its scales at its next forward, so an
    UnfixUnsettled sent when no forward ran since the engine kept a step (sending it whatever
    rank 0's journal holds did) unfixed the kept step's scales on rank 1 (layer 0's K 0.018
    instead of 0.024) and the request went on with other tokens ([..., 125, 17, ...])."""
    options = dict(max_batch=2, max_context=64, kv_cache_dtype="int8", self_check=False)
    model = build_model("tiny-llama", seed=0)
    with Engine(model, **options) as one:
        want = _after_a_failure_before_the_forward(one)
        want_k = one.kv.cache.kv_scales.k.tolist()
    assert want == [33, 235, 255, 48, 89, 149, 182, 110]
    with Engine(model, tensor_parallel_size=2, **options) as engine:
        assert _after_a_failure_before_the_forward(engine) == want
        states = engine.tp.memory_states()
    for rank, state in enumerate(states):
        assert torch.allclose(torch.tensor(state["kv_scales"]["k"]),
                              torch.tensor(want_k)[:, rank:rank + 1], rtol=1e-5), rank


def test_a_memory_utilization_too_large_for_every_rank_is_refused_naming_it():
    """``memory_utilization`` is per rank: 0.6 for 2 ranks spawned on this host is 1.2 of its
    memory. The refusal named cache_bytes, which was not given ("lower cache_bytes (or use
    memory_utilization)"); nothing starts."""
    before = multiprocessing.active_children()
    with pytest.raises(CacheTooLargeError, match=r"^2 tensor-parallel ranks' KV caches \(\d+ "
                                                 r"bytes each\) needs .*; memory_utilization=0\.6 "
                                                 r"is per rank: give at most 1/2$"):
        Engine(build_model("tiny-llama", seed=0), max_batch=2, max_context=64,
               tensor_parallel_size=2, memory_utilization=0.6, self_check=False)
    assert multiprocessing.active_children() == before
