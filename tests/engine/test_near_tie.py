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


def test_random_prompts_are_checked_up_to_a_tie_the_elastic_machine_met():
    """A prompt the elastic state machine drew: after it and token 185, tiny-llama's top two
    logits (119, 181) are 3e-6 apart; transformers' generate picks one, cpu-varlen the other.
    Either is greedy; a flip where the margin is wide, or a short output, is not."""
    pytest.importorskip("transformers")
    from .conftest import greedy_problems, hf_greedy
    prompt = [(217 * 31 + i * 7) % 256 for i in range(14)]
    want = hf_greedy("tiny-llama", [prompt], 17, ignore_eos=True)[0]
    assert want[:1] == [185] and want[1] in (119, 181)
    flipped = [185, 300 - want[1]] + want[2:]          # the other of 119 and 181
    assert greedy_problems("tiny-llama", prompt, want, 17) == []
    assert greedy_problems("tiny-llama", prompt, flipped, 17) == []
    assert greedy_problems("tiny-llama", prompt, [72] + want[1:], 17) != []   # 0.26 apart
    assert greedy_problems("tiny-llama", prompt, want[:5], 17) != []
    assert greedy_problems("tiny-llama", prompt, want[:5], 17, whole=False) == []


def test_the_reference_keeps_prompt_tokens_equal_to_the_pad_id():
    """transformers' generate infers its attention mask from ``pad_token_id`` (tiny-gemma3's
    is 0), so a prompt holding token 0 lost it from the reference's attention: the engine, which
    keeps every prompt token as it should, "differed" from it (4 of 4 samples of such a prompt,
    at margins of 0.0064, five times the near-tie tolerance). The reference now equals greedy
    decoding by plain forwards, and so does the engine."""
    import torch

    from vmemkv.runtime.engine import Engine, SamplingParams

    from .conftest import _hf_greedy, model, prompts, reference_model
    prompt = prompts(4, 24, 40, seed=11)[2]
    ref = reference_model("tiny-gemma3")
    assert ref.generation_config.pad_token_id == 0 and 0 in prompt
    ids, plain = list(prompt), []
    with torch.inference_mode():
        for _ in range(6):
            plain.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(plain[-1])
    assert list(_hf_greedy("tiny-gemma3", tuple(prompt), 6, True)[0]) == plain
    with Engine(model("tiny-gemma3"), max_batch=2, max_context=64) as engine:
        out = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert out[0].outputs[0].token_ids == plain
