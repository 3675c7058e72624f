"""``kv_scales="calibrate"`` reads every K/V write of the calibration pass: on a sliding-window
model the scales came from the last window - 1 tokens transformers' sliding cache keeps
(tiny-mistral-swa, window 32, 256 tokens: layer 0's V scale 0.02214 where all the tokens give
0.03049), not the input's amax the docs promise; a K or V that is not finite is refused
naming its layer (its scale fell back to 1.0)."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv_calibration import calibrated_kv_scales, calibration_ids
from vmemkv.runtime.kv_dtype import first_write_scales, kv_encoding
from vmemkv.runtime.models import build_model

INT8 = kv_encoding("int8", torch.float32)


def _layer_v(model, layer: int, ids) -> torch.Tensor:
    """Layer ``layer``'s V of every token of ``ids`` ([tokens, kv_heads, head_dim]; V takes no
    rope: v_proj's output is what the cache is written)."""
    got = {}
    hook = model.model.layers[layer].self_attn.v_proj.register_forward_hook(
        lambda module, args, out: got.__setitem__("v", out.detach()))
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        hook.remove()
    return got["v"][0].view(len(ids), model.config.num_key_value_heads, -1)


@pytest.mark.parametrize("name", ["tiny-mistral-swa", "tiny-gemma3"])
def test_calibrated_scales_of_windowed_layers_count_every_token(name):
    model = build_model(name, seed=0)
    config = model.config
    ids = calibration_ids(None, config.vocab_size, 1024)
    assert len(ids) > 4 * config.sliding_window                    # 256 tokens, window 32
    got = calibrated_kv_scales(model, None, INT8, config.num_hidden_layers,
                               config.num_key_value_heads, 1024)
    v = _layer_v(model, 0, ids)
    assert torch.tensor(got.v[0]).tolist() == first_write_scales(v, INT8).tolist()
    last = first_write_scales(v[-(config.sliding_window - 1):], INT8)
    assert not torch.equal(torch.tensor(got.v[0]), last)   # what the sliding cache kept


def test_calibration_refuses_kv_that_is_not_finite_naming_the_layer():
    model = build_model("tiny-llama", seed=0)
    hook = model.model.layers[1].self_attn.v_proj.register_forward_hook(
        lambda module, args, out: out + float("inf"))
    try:
        with pytest.raises(CacheConfigError, match="layer 1 V holds NaN or \\+-inf"):
            calibrated_kv_scales(model, None, INT8, 2, 2, 64)
        with pytest.raises(CacheConfigError, match="kv_scales='calibrate'.*layer 1 V"):
            Engine(model, kv_cache_dtype="int8", kv_scales="calibrate", max_batch=2,
                   max_context=64)
    finally:
        hook.remove()


def test_calibration_scores_one_position_of_the_vocabulary_not_every_token():
    """It reads K/V only: the LM head over all ~256 input tokens was ~20% of SmolLM2's pass."""
    model = build_model("tiny-llama", seed=0)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(out.shape[1]))
    try:
        calibrated_kv_scales(model, None, INT8, 2, 2, 1024)
    finally:
        hook.remove()
    assert rows == [1]
