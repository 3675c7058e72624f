"""Sampling values at the edges of floating point never break a request or its neighbours
(issue 27, item 1): a temperature below SAMPLING_EPS is greedy, top_p keeps the likeliest
token, and every field refuses nan, infinities and out-of-range values by name."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams
from vmemkv.runtime.engine.sampler import SampleState, Sampler, make_generator
from vmemkv.runtime.engine.sampling import SAMPLING_EPS

from .conftest import hf_greedy, model, prompts, tokens

EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-38, 1.2e-38, 3.4e38, 1e-6, SAMPLING_EPS, 0.5, 1.0, 2.0, 100.0, 1e308,
               -1e-300, -1.0, -1e308, math.inf, -math.inf, math.nan]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty"]


def test_tiny_temperatures_are_greedy_and_leave_the_engine_usable():
    """On main, temperature 1e-38 overflowed logits / T: 'probability tensor contains inf'
    on every step, the request stayed queued and every later generate failed."""
    batch = prompts(2, 4, 12, seed=41)
    want = hf_greedy("tiny-llama", batch, 6, ignore_eos=True)
    with Engine(model(), max_batch=4, max_context=64) as engine:
        for temperature in (1e-38, 5e-324, 1e-300, 1e-6):
            params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=1,
                                    ignore_eos=True)
            assert params.greedy
            assert tokens(engine.generate(batch, params)) == want
        assert tokens(engine.generate(batch, SamplingParams(max_new_tokens=6, ignore_eos=True))) == want


def test_a_tiny_top_p_keeps_exactly_the_likeliest_token():
    """On main, top_p 1e-300 rounded to 0 in fp32 and dropped every token (nan probabilities)."""
    batch = prompts(2, 4, 12, seed=42)
    want = hf_greedy("tiny-llama", batch, 6, ignore_eos=True)
    with Engine(model(), max_batch=4, max_context=64) as engine:
        for top_p in (1e-300, 5e-324, 1e-45):
            params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=top_p, seed=3,
                                    ignore_eos=True)
            assert tokens(engine.generate(batch, params)) == want



def test_top_p_keeps_every_token_until_the_mass_before_it_reaches_top_p():
    """Probabilities 0.5, 0.3, 0.2 and top_p 0.7: the mass before the second token (0.5) is
    under 0.7, so it is kept although it takes the sum past 0.7; the third (0.8 before) is not."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    sample = SampleState(0, params, make_generator(0, 0, torch.device("cpu")))
    drawn = [Sampler().sample(logits, [sample])[0] for _ in range(400)]
    assert set(drawn) == {0, 1}
    assert 0.25 < drawn.count(1) / len(drawn) < 0.5          # 0.3 / 0.8 = 0.375 of the draws


def test_a_temperature_under_one_sharpens_the_distribution():
    """Scores are divided by the temperature: probabilities 0.6 and 0.4 at temperature 0.25
    become 0.6**4 : 0.4**4, so the second token is drawn about 16.5% of the time (not 47.5%,
    as multiplying by it would flatten them)."""
    logits = torch.tensor([[0.6, 0.4]]).log()
    sample = SampleState(0, SamplingParams(temperature=0.25, seed=0),
                         make_generator(0, 0, torch.device("cpu")))
    drawn = [Sampler().sample(logits, [sample])[0] for _ in range(400)]
    assert 0.1 < drawn.count(1) / len(drawn) < 0.25

@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused_naming_the_field(name, value):
    with pytest.raises(EngineConfigError, match=f"SamplingParams.{name} must be"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name,value", [
    ("temperature", -1e-300), ("top_p", 0.0), ("top_p", 1.0000001), ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 5e-324),
    ("frequency_penalty", 2.5), ("presence_penalty", -2.01), ("max_new_tokens", 0),
    ("top_k", -2), ("n", 0), ("min_tokens", -1), ("min_tokens", 17), ("logprobs", 21),
    ("logprobs", -1), ("prompt_logprobs", 100), ("seed", 1.5), ("ignore_eos", 1),
    ("stop", ("",)), ("stop", ("x" * 1025,)), ("stop", tuple("abcdefghijklmnopq")),
    ("stop_token_ids", tuple(range(1025))), ("stop_token_ids", (-1,)),
    ("logit_bias", {1: 101.0}), ("logit_bias", {1: math.nan}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"a": 1.0}), ("logit_bias", {i: 1.0 for i in range(1025)}),
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", None), ("temperature", True),
])
def test_out_of_range_values_are_refused_naming_the_field(name, value):
    with pytest.raises(EngineConfigError, match=f"SamplingParams.{name} must be"):
        SamplingParams(**{name: value})


def test_defaults_and_containers_are_normalised():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], logit_bias={5: -1.0, 2: 3})
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert p.logit_bias == ((2, 3), (5, -1.0))
    assert SamplingParams().plain_greedy and not SamplingParams(logprobs=0).plain_greedy


@settings(max_examples=150)
@given(st.fixed_dictionaries({}, optional={name: st.sampled_from(EDGE_FLOATS) for name in FLOAT_FIELDS}),
       st.integers(0, 300), st.booleans())
def test_any_accepted_params_sample_a_valid_token(fields, top_k, huge_logits):
    """Fuzz over edge floats: a value is either refused by name or samples a token in the
    vocabulary, with no exception, from ordinary and from huge (1e37, finite) logits."""
    try:
        params = SamplingParams(top_k=top_k, logit_bias={7: 50.0}, min_tokens=1, seed=0,
                                logprobs=2, **fields)
    except EngineConfigError as error:
        assert any(f"SamplingParams.{name} must be" in str(error) for name in fields)
        return
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 256, generator=gen) * (1e37 if huge_logits else 3.0)
    state = SampleState(1, params, make_generator(0, 0, torch.device("cpu")), prompt_ids=(1, 2, 2),
                        output_ids=[3, 3], stop_ids=(2,))
    token = Sampler().sample(logits, [state])[0]
    assert 0 <= token < 256 and token != 2           # min_tokens masks the stop token
    assert state.logprobs.token_id == token and state.logprobs.logprob <= 0.0


def test_a_victim_request_is_unaffected_by_an_extreme_neighbour():
    """A request with extreme values in the same batch changes nothing of another's tokens."""
    victim = prompts(1, 8, 8, seed=43)[0]
    solo_params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=11, ignore_eos=True)
    with Engine(model(), max_batch=4, max_context=64) as engine:
        solo = engine.generate([victim], solo_params)[0].outputs[0].token_ids
        extreme = SamplingParams(max_new_tokens=8, temperature=5e-324, top_p=1e-300, min_p=1.0,
                                 repetition_penalty=1e-3,
                                 frequency_penalty=-2.0, presence_penalty=2.0,
                                 logit_bias={0: -100.0}, ignore_eos=True)
        outs = engine.generate([victim, prompts(1, 5, 5, seed=44)[0]], [solo_params, extreme])
    assert outs[0].outputs[0].token_ids == solo
    assert len(outs[1].outputs[0].token_ids) == 8
