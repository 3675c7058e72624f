"""Pins of the sampler's promises that no other test held exactly (a mutation audit): the
SplitMix64 seed stream, which logits row each sample's finiteness check reads, the clamp of an
overflowing repetition penalty (and the refusal of a tie there), the logprobs bounds, a seed of
0, distinct samples, vLLM's optional forms."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams
from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.runtime.engine.sampler import SampleState, Sampler, processed_scores, splitmix64
from vmemkv.runtime.engine.sampling import (FP32_MAX, FP32_TINY, MAX_LOGPROBS, SAMPLING_EPS,
                                            per_prompt)

from .conftest import model, prompts

ENGINE = dict(cache="vmem", max_batch=4, max_context=64)


def test_splitmix64_is_the_reference_stream():
    """Output i of SplitMix64 seeded with 0 (Vigna's reference generator's first outputs)."""
    assert [splitmix64(0, i) for i in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_each_sample_checks_only_the_logits_row_it_reads():
    """A NaN in a row no sample reads fails nothing; a NaN in the row one reads is named."""
    logits = torch.randn(3, 16)
    logits[0, 5] = float("nan")
    drawn = SampleState(2, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    (token,) = Sampler().sample(logits, [drawn])
    assert 0 <= token < 16
    logits[2, 3] = float("nan")
    with pytest.raises(Exception, match=r"rows \[2\]"):
        Sampler().sample(logits, [drawn])


def test_one_score_a_repetition_penalty_lifts_past_fp32_is_clamped_and_keeps_its_lead():
    """A positive score divided by a tiny penalty passes fp32's range: clamped, never +inf
    (inf - inf in the draw was NaN); alone past it, the penalised token keeps its lead."""
    params = SamplingParams(temperature=1.0, repetition_penalty=FP32_TINY)
    raw = torch.tensor([0.0, 20.0, -1.0, 0.5])   # 20 / 1.2e-38 > 3.4e38; 0.5 / 1.2e-38 is not
    state = SampleState(0, params, torch.Generator().manual_seed(0), prompt_ids=(1, 3))
    scores = processed_scores(raw, state)
    assert bool(torch.isfinite(scores).all())
    assert scores[1].item() == FP32_MAX and scores[3].item() < FP32_MAX
    assert Sampler().sample(raw.unsqueeze(0), [state])[0] == 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_two_scores_a_repetition_penalty_lifts_past_fp32_are_refused_not_tied(temperature):
    """10 / 1.2e-38 and 20 / 1.2e-38 both clamped to fp32's largest value tied: greedy took
    token 0 where token 1 leads (a draw gave them equal odds). Refused, naming the field."""
    params = SamplingParams(temperature=temperature, repetition_penalty=FP32_TINY)
    state = SampleState(0, params, torch.Generator().manual_seed(0), prompt_ids=(0, 1))
    with pytest.raises(RequestRejectedError) as caught:
        Sampler().sample(torch.tensor([[10.0, 20.0, -1.0, 0.5]]), [state])
    assert caught.value.field == "repetition_penalty"
    assert "divides 2 positive scores past float32's range" in str(caught.value)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_counts_up_to_the_limit_are_accepted_and_past_it_refused(name):
    assert getattr(SamplingParams(**{name: MAX_LOGPROBS}), name) == MAX_LOGPROBS == 20
    with pytest.raises(EngineConfigError, match=name):
        SamplingParams(**{name: MAX_LOGPROBS + 1})


def test_duplicate_logit_bias_ids_are_refused_naming_logit_bias():
    """Two biases for one id (pairs, not a dict) are ambiguous: refused, never summed."""
    with pytest.raises(EngineConfigError, match="logit_bias"):
        SamplingParams(logit_bias=[(3, 1.0), (3, 2.0)])
    assert SamplingParams(logit_bias=[(3, 1.0), (4, 2.0)]).logit_bias == ((3, 1.0), (4, 2.0))


def test_one_sampling_params_per_prompt_or_the_counts_are_named():
    params = [SamplingParams(seed=i) for i in range(3)]
    assert per_prompt([[1], [2], [3]], params) == params
    for prompts_given in ([[1], [2]], [[1], [2], [3], [4]]):
        with pytest.raises(EngineConfigError, match=f"got 3 SamplingParams for "
                                                    f"{len(prompts_given)} prompts"):
            per_prompt(prompts_given, params)


def test_temperatures_below_sampling_eps_are_greedy_and_from_it_sampled():
    assert SamplingParams(temperature=SAMPLING_EPS * 0.99).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


@pytest.mark.parametrize("given, stored", [
    (dict(top_k=-1), dict(top_k=0)),
    (dict(stop=None), dict(stop=())),
    (dict(stop_token_ids=None), dict(stop_token_ids=())),
    (dict(logit_bias=None), dict(logit_bias=())),
], ids=["top_k-minus-one", "stop-none", "stop_token_ids-none", "logit_bias-none"])
def test_vllm_optional_forms_are_taken(given, stored):
    """vLLM's SamplingParams takes top_k=-1 ("all tokens") and None for these lists; ours
    refused them (a caller porting vLLM code got an EngineConfigError). Stored as our forms."""
    params = SamplingParams(**given)
    assert params == SamplingParams(**stored) == SamplingParams()
    with pytest.raises(EngineConfigError, match=r"SamplingParams.top_k must be .*got -2"):
        SamplingParams(top_k=-2)
