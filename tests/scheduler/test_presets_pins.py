"""Preset figures the cost model and the managers derive everything from: bytes per token of
each preset (the numbers in presets.py's comments), windows, parameters, cache dtypes."""
import pytest

from vmemkv.scheduler.presets import ModelSpec, get_model, with_kv_cache_dtype


@pytest.mark.parametrize("name, bytes_per_token", [
    ("llama-3-8b", 131_072), ("opt-13b", 819_200), ("mistral-7b-v0.1", 131_072),
    ("gemma-3-27b", 496 * 1024), ("phi-2", 320 * 1024), ("tiny", 4096)])
def test_each_preset_has_the_bytes_per_token_of_k_and_v_over_all_layers(name, bytes_per_token):
    assert get_model(name).bytes_per_token == bytes_per_token


def test_the_window_every_layer_reads_within_is_the_widest():
    model = ModelSpec("two-windows", 2, 1, 8, 2, weight_bytes=0, layer_windows=(4, 16))
    assert model.window_tokens == 16 and model.local_window_tokens == 16
    hybrid = ModelSpec("hybrid", 3, 1, 8, 2, weight_bytes=0, layer_windows=(4, None, 16))
    assert hybrid.window_tokens is None and hybrid.local_window_tokens == 16


@pytest.mark.parametrize("dtype, size", [("fp8_e4m3", 1), ("fp8_e5m2", 1), ("int8", 1),
                                         ("bf16", 2), ("fp16", 2)])
def test_a_cache_dtype_sets_the_bytes_per_token_and_keeps_the_parameters(dtype, size):
    model = ModelSpec("derived", 2, 2, 8, 4, weight_bytes=4000)     # params from the weights
    assert model.params == 1000
    stored = with_kv_cache_dtype(model, dtype)
    assert stored.bytes_per_token == 2 * 2 * 2 * 8 * size and stored.params == 1000
    assert stored.weight_bytes == 4000
