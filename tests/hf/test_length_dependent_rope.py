"""Dynamic-NTK and longrope rotary embeddings pick their frequencies from the largest position in
each forward pass (transformers' ``dynamic_rope_update``); the engine packs several sequences and
prompt chunks into one pass. Before, such a model ran silently wrong: a short request batched
with a long one differed at token 4 (dynamic) or 0 (longrope). Now it is refused above the
threshold, by name, and exact below it (the original frequencies throughout)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.hf.attention import UnsupportedModelError

from .families import BASE

THRESHOLD = 64
NEW_TOKENS = 6


def _dynamic():
    return LlamaForCausalLM(LlamaConfig(**dict(BASE, max_position_embeddings=THRESHOLD,
                                               rope_scaling={"rope_type": "dynamic", "factor": 4.0})))


def _longrope():
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8,
            "long_factor": [float(4 + i) for i in range(8)],
            "original_max_position_embeddings": THRESHOLD}
    return Phi3ForCausalLM(Phi3Config(**dict(BASE, max_position_embeddings=4 * THRESHOLD,
                                             original_max_position_embeddings=THRESHOLD,
                                             rope_scaling=rope, pad_token_id=0)))


BUILDERS = {"dynamic": _dynamic, "longrope": _longrope}


def _model(kind):
    torch.manual_seed(0)
    return BUILDERS[kind]().eval()


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_past_the_threshold_it_is_refused_naming_rope_type_and_the_limit(kind):
    model = _model(kind)
    with pytest.raises(UnsupportedModelError, match=rf"rope_type '{kind}'.*max_context <= {THRESHOLD}"):
        Engine(model, max_batch=2, max_context=THRESHOLD + 1)
    assert model.config._attn_implementation != "vmemkv"


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_within_the_threshold_a_short_prompt_beside_a_long_one_in_chunks_is_exact(kind):
    model = _model(kind)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33], [(7 * i) % 250 + 3 for i in range(50)]]
    want = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    with Engine(model, max_batch=2, max_context=THRESHOLD, max_tokens_per_step=16) as engine:
        got = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == want


def test_a_dynamic_model_whose_frequencies_grew_earlier_is_refused():
    model = _model("dynamic")
    with torch.no_grad():
        model(torch.zeros(1, 2 * THRESHOLD, dtype=torch.long))      # grows transformers' state
    with pytest.raises(UnsupportedModelError, match="grew to"):
        Engine(model, max_batch=2, max_context=THRESHOLD)
