"""VMemCache built with a device spelt with an index torch's tensors do not carry (or without
one they do): the model's K/V states are on the cache's device all the same.

torch compares ``torch.device("cuda")`` unequal to the ``cuda:0`` every CUDA tensor names, and
``torch.device("cpu:0")`` unequal to ``cpu``; the cache compared the states' device with its
config's spelling, so a cache built as docs/usage.md says (``device="cuda"``) refused every
update of a model on that GPU ("key states are ... on cuda:0; this cache holds ... on cuda").
The CPU spelling ``cpu:0`` is the same comparison, and runs here.
"""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.hf import VMemCache  # noqa: E402

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()


def generate(model, cache=None):
    ids = torch.tensor([[0, 0, 7, 8, 9], [1, 2, 3, 4, 5]])      # left-padded batch
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, cache=cache)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)], ids=["str", "torch.device"])
def test_a_cache_on_an_indexed_spelling_of_the_models_device_generates_transformers_tokens(
        llama, device):
    with VMemCache.from_model_config(llama.config, max_batch=2, max_context=64,
                                     device=device) as cache:
        got = generate(llama, cache)
        assert cache.stats().seq_len == got.shape[1] - 1
    assert torch.equal(got, generate(llama))

