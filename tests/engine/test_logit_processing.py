"""Logit processing users send (logit_bias, min_tokens, repetition / frequency / presence
penalties, min_p): the sampler against a plain-Python shadow of each rule, and greedy decoding
through the engine against a step-by-step loop over the model's own forward with the shadow."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.sampler import SampleState, processed_scores

from .conftest import hf_greedy, model, prompts, reference_model, tokens

VOCAB = 256


def shadow_scores(raw: list, params: SamplingParams, prompt: list, output: list, stops: list) -> list:
    """The processing rules written out one token at a time (vLLM's order)."""
    scores = list(raw)
    for t, bias in params.logit_bias:
        scores[t] += bias
    if len(output) < params.min_tokens:
        for t in stops:
            scores[t] = float("-inf")
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            x = scores[t]
            scores[t] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for t in set(output):
        scores[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return scores


@settings(max_examples=60)
@given(raw=st.lists(st.floats(-20, 20), min_size=16, max_size=16),
       prompt=st.lists(st.integers(0, 15), min_size=1, max_size=6),
       output=st.lists(st.integers(0, 15), max_size=6),
       bias=st.dictionaries(st.integers(0, 15), st.floats(-100, 100), max_size=3),
       rep=st.sampled_from([1.0, 0.5, 1.3, 2.0]), freq=st.floats(-2, 2), pres=st.floats(-2, 2),
       min_tokens=st.integers(0, 8))
def test_processing_matches_the_shadow(raw, prompt, output, bias, rep, freq, pres, min_tokens):
    params = SamplingParams(max_new_tokens=8, logit_bias=bias, repetition_penalty=rep,
                            frequency_penalty=freq, presence_penalty=pres, min_tokens=min_tokens)
    state = SampleState(0, params, prompt_ids=tuple(prompt), output_ids=list(output), stop_ids=(3, 9))
    got = processed_scores(torch.tensor(raw, dtype=torch.float32), state).tolist()
    want = shadow_scores(torch.tensor(raw, dtype=torch.float32).tolist(), params, prompt, output, [3, 9])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


def shadow_greedy(prompt: list, params: SamplingParams, steps: int) -> list:
    """Greedy decoding with the shadow rules over the model's own full forward each step."""
    m, ids, out = reference_model("tiny-llama"), list(prompt), []
    for _ in range(steps):
        with torch.inference_mode():
            raw = m(torch.tensor([ids])).logits[0, -1].float().tolist()
        scores = shadow_scores(raw, params, prompt, out, [])
        out.append(max(range(len(scores)), key=scores.__getitem__))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
    dict(frequency_penalty=-1.0, presence_penalty=0.5, logit_bias={17: 4.0, 99: -3.0}),
], ids=["repetition", "frequency", "presence", "mixed-bias"])
def test_penalised_greedy_equals_the_shadow_loop(fields):
    batch = prompts(2, 4, 10, seed=51)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, **fields)
    with Engine(model(), max_batch=4, max_context=64) as engine:
        got = tokens(engine.generate(batch, params))
    assert got == [shadow_greedy(p, params, 8) for p in batch]
    assert got != hf_greedy("tiny-llama", batch, 8, ignore_eos=True)   # the rules did something


def test_a_large_logit_bias_forces_its_token_and_min_tokens_delays_stop_tokens():
    batch = prompts(2, 4, 10, seed=52)
    with Engine(model(), max_batch=4, max_context=64) as engine:
        forced = engine.generate(batch, SamplingParams(max_new_tokens=5, logit_bias={42: 100.0},
                                                       temperature=0.9, seed=1, ignore_eos=True))
        assert all(o.outputs[0].token_ids == [42] * 5 for o in forced)
        first = hf_greedy("tiny-llama", batch, 1, ignore_eos=True)
        for prompt, (stop,) in zip(batch, first):
            plain = engine.generate([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=[stop]))
            assert plain[0].outputs[0].token_ids == [stop]
            held = engine.generate([prompt], SamplingParams(max_new_tokens=6, min_tokens=3,
                                                            stop_token_ids=[stop]))[0].outputs[0]
            assert stop not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_min_p_one_is_greedy():
    batch = prompts(2, 4, 10, seed=53)
    params = SamplingParams(max_new_tokens=6, temperature=1.5, min_p=1.0, seed=2, ignore_eos=True)
    with Engine(model(), max_batch=4, max_context=64) as engine:
        assert tokens(engine.generate(batch, params)) == hf_greedy("tiny-llama", batch, 6, ignore_eos=True)


def test_logit_bias_outside_the_vocabulary_is_refused():
    from vmemkv.runtime.engine import RequestRejectedError
    with Engine(model(), max_batch=2, max_context=32) as engine:
        with pytest.raises(RequestRejectedError, match="logit_bias"):
            engine.add_request([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
        assert not engine.has_unfinished()


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    """A stop id past the vocabulary can never be sampled: a client's mistake, refused by name
    as logit_bias's is (it was taken silently), for sampling and beam search alike."""
    from vmemkv.runtime.engine import BeamSearchParams, RequestRejectedError
    from vmemkv.runtime.engine.errors import BeamSearchParamsError
    with Engine(model(), max_batch=2, max_context=32) as engine:
        with pytest.raises(RequestRejectedError, match=r"stop_token_ids names token ids \[256\]") as info:
            engine.add_request([1, 2], SamplingParams(stop_token_ids=[5, VOCAB]))
        assert info.value.field == "stop_token_ids"
        with pytest.raises(BeamSearchParamsError, match="stop_token_ids"):
            engine.beam_search([[1, 2]], BeamSearchParams(2, max_new_tokens=2,
                                                          stop_token_ids=(10**23,)))
        assert not engine.has_unfinished()
