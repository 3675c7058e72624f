"""VMemCache refuses misuse of ``crop`` and ``reorder_cache`` with a CacheStateError that leaves
the cache as it was: every layer's length, the memory report, and the tokens a following
``generate`` gives (equal to those of a cache that never saw the refused call). Random-weight
built-in model (tiny-llama, 2 layers), nothing downloaded."""
from __future__ import annotations

import warnings

import pytest
import torch

from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.hf import VMemCache
from vmemkv.runtime.models import build_model

pytest.importorskip("transformers")

# two left-padded rows of different prompts: a row copied over the other changes its answer
IDS = torch.tensor([[0, 0, 7, 8, 9], [1, 2, 3, 4, 5]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
FIRST_NEW_TOKENS, NEXT_NEW_TOKENS = 4, 3


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama")


def generate(model, cache, ids, mask, new_tokens):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, cache=cache,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)


def first_call(model, cache):
    """The prompt and 4 new tokens: (output ids, its attention mask)."""
    out = generate(model, cache, IDS, MASK, FIRST_NEW_TOKENS)
    return out, torch.cat([MASK, torch.ones(2, FIRST_NEW_TOKENS, dtype=MASK.dtype)], dim=1)


def new_cache(model):
    return VMemCache.from_model_config(model.config, max_batch=2, max_context=64)


@pytest.fixture(scope="module")
def untouched(model):
    """What a cache that saw no refused call reports and continues with."""
    with new_cache(model) as cache:
        out, mask = first_call(model, cache)
        lengths, stats = [cache.get_seq_length(i) for i in range(2)], cache.stats()
        return lengths, stats, generate(model, cache, out, mask, NEXT_NEW_TOKENS)


def assert_refused_and_unchanged(model, untouched, misuse, words):
    lengths, stats, continued = untouched
    with new_cache(model) as cache:
        out, mask = first_call(model, cache)
        with pytest.raises(CacheStateError, match=words):
            misuse(cache)
        assert [cache.get_seq_length(i) for i in range(2)] == lengths
        assert cache.stats() == stats
        assert torch.equal(generate(model, cache, out, mask, NEXT_NEW_TOKENS), continued)


@pytest.mark.parametrize("count", [-1.5, -2.0, False, torch.tensor(-1)],
                         ids=["float", "whole-float", "bool", "0-d-tensor"])
def test_crop_by_a_count_that_is_not_a_plain_int_is_refused_and_changes_nothing(
        model, untouched, count):
    assert_refused_and_unchanged(model, untouched, lambda cache: cache.crop(count),
                                 r"negative count of tokens to remove \(a plain int")


@pytest.mark.parametrize("beam_idx", [
    torch.tensor([1]),                        # was broadcast: row 1 copied over row 0
    torch.tensor([0, 1, 1]),                  # more rows than held
    torch.tensor([0, 5]),                     # a row past the batch
    torch.tensor([-1, 0]),                    # a negative row
    torch.tensor([[1, 0]]),                   # 2-D
    torch.tensor([1.0, 0.0]),                 # not integers
    [1, 0],                                   # not a tensor
], ids=["one-row", "three-rows", "out-of-range", "negative", "2-d", "float", "list"])
def test_reorder_cache_by_an_index_that_is_not_one_row_per_row_held_is_refused_and_changes_nothing(
        model, untouched, beam_idx):
    assert_refused_and_unchanged(model, untouched, lambda cache: cache.reorder_cache(beam_idx),
                                 r"one row in \[0, 2\) for each of the 2 rows held")


def test_crop_after_close_is_refused_and_the_cache_stays_closed(model):
    cache = new_cache(model)
    first_call(model, cache)
    cache.close()
    with pytest.raises(CacheStateError, match=r"after close\(\)"):
        cache.crop(-1)
    with pytest.raises(CacheStateError, match=r"after close\(\)"):
        cache.get_seq_length()
    assert "closed" in repr(cache)
