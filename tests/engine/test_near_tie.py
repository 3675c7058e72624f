"""The near-tie rule the GPU greedy tests use (tests/engine/near_tie.py), on the CPU."""
import pytest

from .near_tie import hf_greedy_with_margins, near_tie_mismatches


def test_equal_tokens_pass_and_a_flip_passes_only_at_a_near_tie():
    ref, margins = [[5, 6, 7]], [[0.5, 1e-5, 0.5]]
    assert near_tie_mismatches([[5, 6, 7]], ref, margins) == []
    assert near_tie_mismatches([[5, 9, 1]], ref, margins) == []          # flip at the tie
    assert near_tie_mismatches([[5, 6, 8]], ref, margins) == [
        "request 0: token 2 is 8, reference 7 with a top-two margin of 0.5 >= 0.001"]
    assert near_tie_mismatches([[5, 6]], ref, margins) == ["request 0: 2 tokens, reference 3"]


def test_margins_come_from_the_references_own_scores():
    pytest.importorskip("transformers")
    from vmemkv.runtime.models import build_model
    model = build_model("tiny-llama", seed=0)
    model.generation_config.eos_token_id = None
    tokens, margins = hf_greedy_with_margins(model, [[1, 2, 3, 4]], 5)
    assert len(tokens[0]) == len(margins[0]) == 5 and all(m >= 0 for m in margins[0])
    assert near_tie_mismatches(tokens, tokens, margins) == []
