"""Sampling and logprobs edge cases a user of ``Engine.generate`` meets (hunt 31), each checked
against a plain torch reference: top logprobs on a vocabulary smaller than k; ints in float
fields (huge ones refused by name, in-range ones sampled as their float); logit_bias keys
that do not sort."""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.engine.errors import EngineConfigError  # noqa: E402
from vmemkv.runtime.engine.logprobs import rows_logprobs  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

SMALL_VOCAB = 16      # a DNA / toy model: fewer tokens than logprobs' limit of 20


@functools.lru_cache(maxsize=None)
def small_vocab_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.15,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def reference_logprobs(ids: list) -> torch.Tensor:
    """log_softmax of a plain forward: row i predicts token i + 1."""
    with torch.inference_mode():
        logits = small_vocab_model()(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_top_logprobs_past_a_small_vocabulary_list_every_token_likeliest_first():
    prompt = [1, 5, 9, 3, 7]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    with Engine(small_vocab_model(), max_batch=2, max_context=64) as engine:
        out = engine.generate([prompt], params)[0]
    sample = out.outputs[0]
    assert out.error is None and sample.finish_reason == "length"
    reference = reference_logprobs(prompt + sample.token_ids)
    entries = [(i, e) for i, e in enumerate(out.prompt_logprobs) if e is not None]
    entries += [(len(prompt) + j, e) for j, e in enumerate(sample.logprobs)]
    assert len(entries) == len(prompt) - 1 + 3
    for position, entry in entries:
        row = reference[position - 1]
        assert [t for t, _ in entry.top] == row.topk(SMALL_VOCAB).indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(row.topk(SMALL_VOCAB).values.tolist(),
                                                          abs=1e-4)
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)


def test_tied_tokens_share_the_best_rank_so_a_greedy_token_is_always_rank_1():
    """The rank counts the strictly likelier tokens (vLLM v0's count; v1's counts the tied ones
    too, so a greedy token tied with another reported rank 2 there): pinned, as documented."""
    row = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    ranks = [rows_logprobs(row, [t], 0)[0].rank for t in range(5)]
    assert ranks == [4, 1, 1, 5, 1]
    reference = torch.log_softmax(row[0].double(), -1)
    assert [e.logprob for e in rows_logprobs(row.repeat(5, 1), list(range(5)), 0)] == \
        pytest.approx(reference.tolist(), abs=1e-6)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "frequency_penalty", "presence_penalty", "logit_bias"])
def test_an_int_past_a_floats_range_is_refused_naming_its_field(field):
    """10**400 in a float field was math.isfinite's bare OverflowError."""
    value = {1: 10**400} if field == "logit_bias" else -10**400 if field == "repetition_penalty" \
        else 10**400
    with pytest.raises(EngineConfigError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})


def test_an_int_temperature_or_repetition_penalty_in_range_samples_as_its_float():
    """10**30 is in range (at most 3.4e38) and was accepted, then the draw's tensor division
    raised OverflowError ("int too big to convert") out of generate."""
    as_int = [SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=10**30, seed=1),
              SamplingParams(max_new_tokens=3, ignore_eos=True, repetition_penalty=10**30)]
    as_float = [SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1e30, seed=1),
                SamplingParams(max_new_tokens=3, ignore_eos=True, repetition_penalty=1e30)]
    with Engine(build_model("tiny-llama", seed=0), max_batch=4, max_context=64) as engine:
        got = engine.generate([[1, 2, 3], [4, 5, 6]], as_int)
        want = engine.generate([[1, 2, 3], [4, 5, 6]], as_float)
    assert [o.status for o in got] == ["finished", "finished"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert as_int == as_float and type(as_int[0].temperature) is float


@pytest.mark.parametrize("bias", [{(1, 2): 1.0, (1, "a"): 2.0}, {1j: 1.0, 2j: 2.0}],
                         ids=["tuple-keys", "complex-keys"])
def test_logit_bias_keys_that_do_not_sort_are_refused_naming_logit_bias(bias):
    """Sorting the pairs compared the keys: a bare TypeError before the field's own check."""
    with pytest.raises(EngineConfigError, match="SamplingParams.logit_bias must be"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={9: 1, 3: 2}).logit_bias == ((3, 2), (9, 1))
