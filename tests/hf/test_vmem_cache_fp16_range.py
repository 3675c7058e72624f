"""kv_cache_dtype="fp16" under a bf16 model: fp16 holds no value past 65504, which bf16 K/V can
reach. Such states were stored as inf, attention returned NaN and transformers' generate
picked token 0 for every step, with no error (DynamicCache, storing bf16, answers). They are
refused before anything is written (NonFiniteKVError naming the value); K/V within fp16's range
are stored as before."""
import pytest
import torch
import transformers

from vmemkv.runtime.errors import NonFiniteKVError
from vmemkv.runtime.hf import VMemCache

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model(key_scale: float):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(key_scale)
    return model


def _cache(model):
    return VMemCache.from_model_config(model.config, max_batch=2, max_context=64,
                                       page_bytes=4096, dtype=torch.bfloat16,
                                       kv_cache_dtype="fp16")


IDS = torch.tensor([[5, 9, 17, 33, 4, 60, 7], [8, 11, 3, 90, 21, 5, 44]])


def test_bf16_keys_past_fp16s_range_are_refused_before_anything_is_written():
    model = _model(1e6)                       # keys of order 1e6: finite in bf16
    cache = _cache(model)
    with pytest.raises(NonFiniteKVError, match=r"key states hold .* past 65504.*'fp16'"):
        with torch.no_grad():
            model(IDS, cache=cache, use_cache=True)
    stats = cache.stats()
    assert (cache.get_seq_length(), stats.batch, stats.mapped_pages) == (0, 0, 0)
    # the same cache then serves a model in range: nothing of the refused call stayed
    sane = _model(1.0)
    with torch.no_grad():
        ours = sane.generate(IDS, max_new_tokens=6, do_sample=False, cache=cache)
        theirs = sane.generate(IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, theirs)


def test_fp16_storage_within_range_keeps_transformers_tokens():
    model = _model(1.0)
    with torch.no_grad():
        ours = model.generate(IDS, max_new_tokens=6, do_sample=False, cache=_cache(model))
        theirs = model.generate(IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, theirs)
