"""Sampling fields given as Python ints where floats are allowed: OpenAI's own examples write
logit_bias as ints ({"50256": -100}), and SamplingParams accepts and keeps them as ints."""
from __future__ import annotations

import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.sampler import SampleState, processed_scores

from .conftest import model, prompts


def test_an_int_logit_bias_is_added_as_its_float_value():
    # it was index_add_'s RuntimeError: "self (Float) and source (Long) must have the same
    # scalar type"
    raw = torch.linspace(-1.0, 1.0, 8)
    params = SamplingParams(logit_bias={3: 5, 6: -100})
    scores = processed_scores(raw, SampleState(0, params))
    expected = raw.clone()
    expected[3] += 5.0
    expected[6] -= 100.0
    assert torch.equal(scores, expected)


def test_an_int_logit_bias_steers_greedy_decoding_and_the_request_finishes():
    # through the engine the request ended "failed" with no tokens, its neighbour unharmed
    favourite = 7
    batch = prompts(2, 5, 8, seed=30)
    with Engine(model(), max_batch=4, max_context=64) as engine:
        out = engine.generate(batch, [SamplingParams(max_new_tokens=3),
                                      SamplingParams(max_new_tokens=3, ignore_eos=True,
                                                     logit_bias={favourite: 100})])
    assert [request.status for request in out] == ["finished", "finished"]
    assert out[1].outputs[0].token_ids == [favourite] * 3
    assert out[1].outputs[0].finish_reason == "length"
