"""Logprobs and prompt logprobs: the model's raw distribution at each position, equal to a plain
forward of the model; top-k lists sorted and consistent; prompt logprobs computed for every
prompt token even when prefix sharing could have served the prompt; only requests that ask keep
their prompt rows' logits."""
from __future__ import annotations

import math

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import model, prompts, reference_model

TOLERANCE = 1e-4   # nats


def forward_logprobs(ids: list) -> torch.Tensor:
    """log_softmax of the model's own forward over ``ids``: row i predicts token i + 1."""
    with torch.inference_mode():
        logits = reference_model("tiny-llama")(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_token_logprobs_are_the_raw_model_distribution(temperature):
    batch = prompts(3, 4, 20, seed=61)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, seed=4, logprobs=5,
                            ignore_eos=True, repetition_penalty=1.2)
    with Engine(model(), max_batch=4, max_context=64, cache="paged", block_size=4) as engine:
        outs = engine.generate(batch, params)
    for prompt, out in zip(batch, outs):
        sample = out.outputs[0]
        reference = forward_logprobs(prompt + sample.token_ids)
        assert len(sample.logprobs) == len(sample.token_ids)
        for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            row = reference[len(prompt) - 1 + step]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
            assert entry.rank == int((row > row[token]).sum()) + 1
            assert [t for t, _ in entry.top] == row.topk(5).indices.tolist()
            values = [v for _, v in entry.top]
            assert values == sorted(values, reverse=True)
        assert sample.cumulative_logprob == pytest.approx(sum(e.logprob for e in sample.logprobs))


def test_streamed_events_carry_the_logprobs_of_the_output():
    params = SamplingParams(max_new_tokens=4, logprobs=0, ignore_eos=True)
    with Engine(model(), max_batch=2, max_context=64) as engine:
        events = list(engine.stream([[5, 6, 7]], params))
        final = engine.last_outputs[0].outputs[0]
    assert [e.logprobs for e in events] == final.logprobs and final.logprobs[0].top == ()


@pytest.mark.parametrize("options", [
    dict(cache="vmem", page_bytes=4096), dict(cache="paged", block_size=4),
    dict(cache="vmem", page_bytes=4096, max_tokens_per_step=8),           # chunked prefill
], ids=["vmem", "paged", "chunked"])
def test_prompt_logprobs_equal_a_plain_forward(options):
    batch = prompts(3, 12, 30, seed=62)
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=3, ignore_eos=True)
    with Engine(model(), max_batch=4, max_context=64, **options) as engine:
        outs = engine.generate(batch, params)
    for prompt, out in zip(batch, outs):
        reference = forward_logprobs(prompt)
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for i in range(1, len(prompt)):
            assert entries[i].token_id == prompt[i]
            assert entries[i].logprob == pytest.approx(reference[i - 1, prompt[i]].item(), abs=TOLERANCE)
            assert [t for t, _ in entries[i].top] == reference[i - 1].topk(3).indices.tolist()
        nll = -sum(e.logprob for e in entries[1:])
        want = -sum(reference[i - 1, prompt[i]].item() for i in range(1, len(prompt)))
        assert math.isclose(nll, want, abs_tol=TOLERANCE * len(prompt))


def test_prompt_logprobs_are_computed_on_a_prefix_cache_hit():
    """A repeated prompt would be served from the prefix cache; one asking for prompt logprobs
    is computed in full instead, so no entry is missing."""
    prompt = prompts(1, 40, 40, seed=63)[0]
    with Engine(model(), max_batch=4, max_context=64, cache="paged", block_size=4,
                prefix_sharing=True) as engine:
        engine.generate([prompt], SamplingParams(max_new_tokens=2))
        engine.generate([prompt], SamplingParams(max_new_tokens=2))
        assert engine.last_stats.prefix_cache_hits > 0             # the plain repeat hits
        out = engine.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=0, n=2))[0]
        assert engine.last_stats.prefix_cache_hits == 0
    reference = forward_logprobs(prompt)
    assert all(out.prompt_logprobs[i].logprob == pytest.approx(reference[i - 1, prompt[i]].item(),
                                                               abs=TOLERANCE)
               for i in range(1, len(prompt)))


def test_only_requests_that_ask_keep_their_prompt_rows():
    kept = []
    m = model()
    forward = m.forward

    def recording(*args, **kwargs):
        kept.append(len(kwargs["logits_to_keep"]))
        return forward(*args, **kwargs)

    batch = prompts(2, 10, 10, seed=64)
    with Engine(m, max_batch=4, max_context=64) as engine:
        m.forward = recording
        try:
            engine.generate(batch, [SamplingParams(max_new_tokens=2),
                                    SamplingParams(max_new_tokens=2, prompt_logprobs=1)])
            engine.generate(batch, SamplingParams(max_new_tokens=2))
        finally:
            del m.forward
    assert kept == [1 + 10, 2, 2, 2]   # prefill: one sampled row + the asking prompt's 10 rows
