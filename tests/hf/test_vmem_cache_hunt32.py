"""VMemCache under ``model.generate`` (hunt 32): forwards the cache cannot continue exactly are
refused by name at their first update (runtime/hf/cache_checks.py: ``check_forward_start``),
nothing written, instead of generating wrong tokens. Random-weight tiny models, fp32, seed 0;
the reference is the same ``generate`` on transformers' own cache."""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.errors import CacheStateError  # noqa: E402
from vmemkv.runtime.hf import VMemCache  # noqa: E402

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0)
IDS = torch.tensor([[0, 0, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]])      # left-padded batch of 2
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
NEW_TOKENS = 6


def build(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                         n_positions=256, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2)
        return transformers.GPT2LMHeadModel(config).eval()
    if family == "gemma2":   # a windowed layer, soft-capping, no use_cache handed to update
        config = transformers.Gemma2Config(**SHAPE, head_dim=16, sliding_window=4)
        return transformers.Gemma2ForCausalLM(config).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()


def generate(model, ids=IDS, mask=MASK, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              **kwargs)


def new_cache(model) -> VMemCache:
    return VMemCache.from_model_config(model.config, max_batch=2, max_context=128)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_generate_with_use_cache_false_and_a_cache_is_refused_naming_use_cache(family):
    """generate(use_cache=False) re-feeds the whole sequence every step; with a cache passed,
    the cache appended it behind the prompt (13 tokens cached after 2 steps of a 6-token
    prompt) and generate went on with wrong tokens, unsaid."""
    model = build(family)
    with new_cache(model) as cache:
        with pytest.raises(CacheStateError, match=r"hands the cache 7 tokens whose positions "
                                                  r"end at 6, so they sit among the 6 tokens "
                                                  r"it holds: .*use_cache=False"):
            generate(model, cache=cache, use_cache=False)
        assert [cache.get_seq_length(i) for i in range(2)] == [6, 6]   # the prompt, as before
        cache.reset()
        assert torch.equal(generate(model, cache=cache), generate(model))


def test_a_forward_that_raised_part_way_refuses_the_next_by_name_until_reset():
    """A prefill that raised in layer 1 left layer 0 holding the prompt and layer 1 nothing; a
    retried generate was positioned by layer 0 and failed in torch on the sizes (untyped)."""
    model = build("llama")

    def interrupt(module, args, kwargs):
        raise KeyboardInterrupt("Ctrl-C in layer 1")

    with new_cache(model) as cache:
        hook = model.model.layers[1].register_forward_pre_hook(interrupt, with_kwargs=True)
        with pytest.raises(KeyboardInterrupt):
            generate(model, cache=cache)
        hook.remove()
        for _ in range(2):                        # refused every time, nothing written
            with pytest.raises(CacheStateError, match=r"raised part-way: its layers hold "
                                                      r"\[6, 0\] tokens.*call reset\(\)"):
                generate(model, cache=cache)
            assert [cache.get_seq_length(i) for i in range(2)] == [6, 0]
        cache.reset()
        assert torch.equal(generate(model, cache=cache), generate(model))


def test_a_longer_second_turn_on_extra_left_padding_is_not_taken_for_a_refeed():
    """The re-feed check reads positions: a continuation of more tokens than the cache holds,
    on rows padded past the longest prompt, still continues them exactly."""
    model = build("llama")
    ids, mask = torch.cat([torch.zeros(2, 3, dtype=IDS.dtype), IDS], 1), \
        torch.cat([torch.zeros(2, 3, dtype=MASK.dtype), MASK], 1)
    turn = torch.randint(3, 120, (2, 15), generator=torch.Generator().manual_seed(1))
    with new_cache(model) as cache:
        first = generate(model, ids, mask, cache=cache)
        ids2 = torch.cat([first, turn], 1)
        mask2 = torch.cat([mask, torch.ones(2, NEW_TOKENS + 15, dtype=mask.dtype)], 1)
        assert torch.equal(generate(model, ids2, mask2, cache=cache), generate(model, ids2, mask2))


@pytest.mark.parametrize("chunk", [2, 3])
def test_a_chunked_prefill_over_padding_only_is_not_taken_for_a_refeed(chunk):
    """Every row padded past its prompt (pad_to_multiple_of): a prefill chunk after chunks of
    padding only starts back at position 0, and was refused as a re-feed."""
    model = build("llama")
    ids = torch.cat([torch.zeros(2, 4, dtype=IDS.dtype), IDS[:, 3:]], 1)   # >= 4 pads per row
    mask = (ids != 0).long()
    with new_cache(model) as cache:
        got = generate(model, ids, mask, cache=cache, prefill_chunk_size=chunk)
    assert torch.equal(got, generate(model, ids, mask, prefill_chunk_size=chunk))
