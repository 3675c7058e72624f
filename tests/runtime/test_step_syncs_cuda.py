"""Issue 17 item 2 on a GPU: host-device syncs per step, counted by CUDA itself.

tests/runtime/test_step_metadata.py proves on the CPU that metadata is built once per step;
here ``torch.cuda.set_sync_debug_mode("warn")`` reports every synchronising CUDA call during a
greedy generate, and the count must stay per step (the sampled tokens, at most 2 per step),
never per layer.
"""
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_host_device_syncs_are_per_step_not_per_layer(cache):
    model = build_model("small-llama", seed=0, dtype=torch.float16, device="cuda")
    prompts = [[1 + (i * 7 + j) % 90 for j in range(8 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with Engine(model, max_batch=4, max_context=64, cache=cache) as engine:
        engine.generate(prompts, params)                 # warm-up: allocator, kernels, tables
        layers = engine.cache_config.num_layers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(prompts, params)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        steps = engine.last_stats.steps
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert steps > 0 and layers > 2
    assert len(syncs) <= 2 * steps, f"{len(syncs)} syncs in {steps} steps: {syncs[:3]}"
