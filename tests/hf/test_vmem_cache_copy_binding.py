"""A deep copy of a VMemCache (transformers' prompt-reuse recipe) serves the model its original
was built for as the original does: its guard knows the model (runtime/hf/cache_guard.py).

The copy was built from the CacheConfig alone, so its guard was a plain cache's: a model on the
engine's "vmemkv" attention wrote layer 0 of the copy before that attention refused the call
(the retry on the model's own attention then failed on the stale rows, an untyped size
mismatch), and Gemma 3n's KV-shared layers, which never write, left the copy held by the thread
of its first forward (another thread's next generate refused)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.errors import CacheStateError  # noqa: E402
from vmemkv.runtime.hf import VMemCache  # noqa: E402

from .test_vmem_cache_guard_pins import in_another_thread, write  # noqa: E402
from .window_families import gemma3n_kv_shared_config  # noqa: E402

IDS = torch.tensor([[0, 0, 7, 8, 9], [1, 2, 3, 4, 5]])      # left-padded batch
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def generate(model, cache):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(IDS, attention_mask=MASK, max_new_tokens=6, min_new_tokens=6,
                              do_sample=False, cache=cache)


def test_a_copy_is_refused_before_it_is_written_when_the_model_is_on_the_engines_attention():
    from vmemkv.runtime.hf.attention import use_vmemkv_attention
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()
    want = generate(model, None)
    own = model.config._attn_implementation
    with VMemCache.from_model_config(model.config, max_batch=2, max_context=64) as cache, \
            copy.deepcopy(cache) as twin:
        use_vmemkv_attention(model)
        try:
            with pytest.raises(CacheStateError, match="'vmemkv' attention"):
                generate(model, twin)
            assert [layer.get_seq_length() for layer in twin.layers] == [0, 0]
        finally:
            model.set_attn_implementation(own)
        assert torch.equal(generate(model, twin), want)


def test_a_copy_of_a_gemma3n_cache_is_handed_to_another_thread_after_its_forward():
    config = gemma3n_kv_shared_config()
    with VMemCache.from_model_config(config, max_batch=1, max_context=64) as cache:
        write(cache, 0, 5)
        write(cache, 1, 5)                          # layers 2 and 3 read these: forward done
        with copy.deepcopy(cache) as twin:
            write(twin, 0)
            write(twin, 1)                          # the copy's own forward, done
            assert in_another_thread(twin, 0) is None
            assert [layer.get_seq_length() for layer in twin.layers] == [7, 6, 0, 0]
