"""``kv_scales="calibrate"``: 8-bit scales fixed when the engine is built, from a fixed input,
so no request sets another's precision: the same scales and the same tokens whichever prompt
comes first (first-write scales, the control, differ), the scales a first write of the
calibration input gives, a checkpoint's scales still first, bad values refused by name."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineConfigError
from vmemkv.runtime.kv_calibration import CALIBRATION_TOKENS, calibration_ids
from vmemkv.runtime.models import build_model

from .conftest import model, prompts, tokens
from .test_engine_kv_checkpoint_scales import OPTIONS, checkpoint_model

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _in_order(batch, kv_scales, kv_cache_dtype="fp8_e4m3"):
    """(scales before any request, scales after, tokens of each prompt) on one engine that
    runs ``batch``'s prompts one at a time, in order."""
    with Engine(model(), kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, **OPTIONS) as e:
        table = e.kv.cache.kv_scales
        before = (table.k.clone(), table.v.clone(), list(table.fixed))
        outs = [tokens(e.generate([p], PARAMS))[0] for p in batch]
        return before, (table.k.clone(), table.v.clone()), outs


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_calibrated_scales_and_tokens_do_not_depend_on_which_prompt_comes_first(kv_cache_dtype):
    # prompts far apart in magnitude: token ids from different ends of the vocabulary
    a, b = prompts(1, 20, 20, seed=1)[0], prompts(1, 6, 6, seed=9)[0]
    before, after_ab, (ab_a, ab_b) = _in_order([a, b], "calibrate", kv_cache_dtype)
    _, after_ba, (ba_b, ba_a) = _in_order([b, a], "calibrate", kv_cache_dtype)
    assert before[2] == [True, True]                    # fixed before any request
    for x, y, z in zip(before[:2], after_ab, after_ba):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert (ab_a, ab_b) == (ba_a, ba_b)
    # the control: first-write scales are the first prompt's, so the order changes them
    first, ab, _ = _in_order([a, b], None, kv_cache_dtype)
    _, ba, _ = _in_order([b, a], None, kv_cache_dtype)
    assert first[2] == [False, False]
    assert not torch.equal(ab[0], ba[0]) and not torch.equal(ab[1], ba[1])


def test_calibrated_scales_are_amax_over_max_of_the_full_precision_kv_of_the_input():
    m = model()
    ids = calibration_ids(None, m.config.vocab_size, 10_000)
    assert len(ids) == CALIBRATION_TOKENS and len(calibration_ids(None, 10, 64)) == 64
    # max_context above the input (no cut); the whole input in one step
    options = dict(OPTIONS, max_context=2 * CALIBRATION_TOKENS,
                   max_tokens_per_step=CALIBRATION_TOKENS)
    with Engine(m, kv_cache_dtype="int8", kv_scales="calibrate", **options) as e:
        calibrated = e.kv.cache.kv_scales
        assert e.kv_scales_source == "calibrated"
        assert e.cache_config.kv_scales.k == tuple(map(tuple, calibrated.k.tolist()))
    with Engine(m, **options) as e:    # fp32 K/V of the input, as the engine writes them
        seq = e.add_request(ids, SamplingParams(max_new_tokens=4))
        e.step()
        kv = [e.kv.cache.read(seq, layer, len(ids)) for layer in range(2)]
    for i, name in enumerate("kv"):
        # [tokens, kv_heads, head_dim] -> per KV head; another attention backend sums layer
        # 0's attention in another order (1e-6) under layer 1's
        want = torch.stack([x[i].abs().amax(dim=(0, 2)) / 127 for x in kv])
        torch.testing.assert_close(getattr(calibrated, name), want, rtol=1e-5, atol=0)


def test_a_checkpoints_scales_come_before_calibration_and_windowed_models_calibrate():
    with Engine(checkpoint_model(), kv_cache_dtype="fp8_e4m3", kv_scales="calibrate",
                **OPTIONS) as e:
        assert e.kv_scales_source == "checkpoint"
    gemma = build_model("tiny-gemma3", seed=0)   # sliding-window and full layers
    with Engine(gemma, kv_cache_dtype="fp8_e4m3", kv_scales="calibrate", max_batch=2,
                max_context=128, self_check=False) as e:
        table = e.kv.cache.kv_scales
        assert e.kv_scales_source == "calibrated" and all(table.fixed)
        assert bool((table.k > 0).all()) and not torch.equal(table.k, torch.ones_like(table.k))


@pytest.mark.parametrize("kv_cache_dtype, kv_scales, names", [
    ("fp8_e4m3", "calibrated", "'calibrate'"),          # a typo
    ("bf16", "calibrate", "fp8_e4m3, fp8_e5m2 and int8"),   # nothing to calibrate
])
def test_bad_kv_scales_are_refused_by_name(kv_cache_dtype, kv_scales, names):
    with pytest.raises(EngineConfigError, match="kv_scales") as error:
        Engine(model(), kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, **OPTIONS)
    assert names in str(error.value)


def test_calibration_runs_beside_another_engine_on_the_same_model():
    """The calibration forward needs the model's own attention: another engine has switched
    the model to ours (it raised UnsupportedModelError: no vmemkv_step in the call); it runs
    on the model's own and leaves ours in place for the other engine."""
    m = model()
    with Engine(m, **OPTIONS) as first:
        assert m.config._attn_implementation == "vmemkv"
        with Engine(m, kv_cache_dtype="int8", kv_scales="calibrate", **OPTIONS) as second:
            assert second.kv_scales_source == "calibrated" and all(second.kv.cache.kv_scales.fixed)
            assert m.config._attn_implementation == "vmemkv"
            assert len(tokens(second.generate([[1, 2, 3]], PARAMS))[0]) == 8
        assert len(tokens(first.generate([[1, 2, 3]], PARAMS))[0]) == 8

