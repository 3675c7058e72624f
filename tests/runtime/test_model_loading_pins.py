"""Model loading helpers pinned at their edges: the seed range's top, the weight-gap report's
cut-off and the EOS ids generation stops at."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime.models import (MAX_SEED, ModelLoadError, check_model_arguments,
                                   eos_token_ids, weight_gaps)


def test_the_largest_seed_is_taken_and_one_past_it_is_refused():
    check_model_arguments(MAX_SEED, torch.float32, "cpu")
    assert MAX_SEED == 2**64 - 1
    with pytest.raises(ModelLoadError, match=r"seed must be an int in \[0, 2\*\*64 - 1\]"):
        check_model_arguments(MAX_SEED + 1, torch.float32, "cpu")


def test_weight_gaps_lists_four_names_whole_and_counts_the_rest():
    four = ["w.a", "w.b", "w.c", "w.d"]
    assert weight_gaps({"missing_keys": four}) == "4 missing: w.a, w.b, w.c, w.d"
    assert weight_gaps({"unexpected_keys": four + ["w.e"]}) == \
        "5 unused: w.a, w.b, w.c, w.d and 1 more"


def test_eos_token_ids_keep_every_id_of_a_list_and_fall_back_to_the_tokenizer():
    model = lambda eos: SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))  # noqa: E731
    assert eos_token_ids(model([2, 7])) == (2, 7)
    assert eos_token_ids(model(5)) == (5,)
    assert eos_token_ids(model(None), SimpleNamespace(eos_token_id=3)) == (3,)
    assert eos_token_ids(model(None)) == ()



def test_load_model_builds_a_builtin_from_the_seed_it_is_given():
    from vmemkv.runtime.models import build_model, load_model
    model, tokenizer = load_model("tiny-llama", seed=1)
    weight = model.model.embed_tokens.weight
    assert tokenizer is None
    assert torch.equal(weight, build_model("tiny-llama", seed=1).model.embed_tokens.weight)
    assert not torch.equal(weight, build_model("tiny-llama", seed=0).model.embed_tokens.weight)
