"""One device-to-host sync per step, not per layer: a cache builds the step's metadata and
every layer's view once in begin_step, and backends validate and derive per step."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from vmemkv.runtime.attention.base import BatchLens, PagedLayerView, VMemLayerView  # noqa: E402
from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402

from tests.engine.conftest import model, prompts  # noqa: E402

CACHES = {"vmem-per-layer": dict(cache="vmem", layout="per-layer"),
          "vmem-interleaved": dict(cache="vmem", layout="interleaved"),
          "paged": dict(cache="paged", block_size=4)}


class Counter:
    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("cache", list(CACHES))
def test_step_metadata_is_built_once_per_step_and_read_back_never_per_layer(cache, monkeypatch):
    engine = Engine(model(), max_batch=4, max_context=64, **CACHES[cache])
    layers = engine.cache_config.num_layers
    assert layers > 1
    steps = {"n": 0}
    execute = engine.runner.execute

    def counting_execute(plan):
        steps["n"] += bool(plan.seqs)
        return execute(plan)

    engine.runner.execute = counting_execute
    builds = Counter(monkeypatch, type(engine.kv.cache), "_build_step_views")
    from_device = Counter(monkeypatch, BatchLens, "from_tensors")
    validations = Counter(monkeypatch, VMemLayerView, "_validate")
    paged_validations = Counter(monkeypatch, PagedLayerView, "_validate")
    tolist = Counter(monkeypatch, torch.Tensor, "tolist")
    with engine:
        engine.generate(prompts(3, 4, 20, seed=2), SamplingParams(max_new_tokens=6))
    assert steps["n"] > 0
    assert builds.calls == steps["n"]                    # one metadata build per step
    assert validations.calls + paged_validations.calls == steps["n"]  # not once per layer
    assert from_device.calls == 0                        # lens come from the host copy
    assert tolist.calls <= steps["n"]                    # the sampled tokens only: slots and
                                                         # tables come from the host copy
