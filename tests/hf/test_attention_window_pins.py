"""The "vmemkv" attention refuses a layer whose sliding window differs from the one its cache was
built for, either way round: the cache reads, and gives back memory, by its own per-layer
windows, so a full-attention layer on a windowed cache would attend over a window silently."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.hf.attention import StepContext, UnsupportedModelError, vmemkv_attention


@pytest.mark.parametrize("attends, built", [(None, 16), (8, 16), (16, None)],
                         ids=["full-on-windowed", "other-window", "windowed-on-full"])
def test_a_layer_attending_with_another_window_than_its_cache_is_refused(attends, built):
    config = CacheConfig(num_layers=1, num_kv_heads=2, head_dim=16, layer_windows=(built,))
    ctx = StepContext(cache=SimpleNamespace(config=config), backend=None)   # nothing is written
    module = SimpleNamespace(layer_idx=0, is_causal=True)
    query, key = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16)
    with pytest.raises(UnsupportedModelError,
                       match=f"sliding window of {attends} tokens but its cache was built for "
                             f"{built}"):
        vmemkv_attention(module, query, key, key, None, sliding_window=attends, vmemkv_step=ctx)


@torch.no_grad()
def test_own_attention_runs_a_model_left_on_ours_by_hand_on_sdpa_and_gives_it_back():
    """A model switched to "vmemkv" with no engine holding it has no own implementation to go
    back to: ``own_attention`` runs it on sdpa (a plain forward works), then leaves it on ours."""
    from vmemkv.runtime.hf.attention import ATTN_IMPLEMENTATION, own_attention, use_vmemkv_attention
    from vmemkv.runtime.models import build_model
    model = build_model("tiny-llama")
    use_vmemkv_attention(model)
    with own_attention(model):
        assert model.config._attn_implementation == "sdpa"
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 256)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
