"""One device-to-host sync per step, not per layer: a cache builds the step's metadata and
every layer's view once in begin_step, and backends validate and derive per step."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from vmemkv.runtime.attention.views import BatchLens, PagedLayerView, VMemLayerView  # noqa: E402
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


def _filled_views(kind: str):
    from vmemkv.runtime.config import CacheConfig
    from vmemkv.runtime.kv import make_kv
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=4, max_context=64)
    kv = make_kv(config, kind, page_bytes=4096) if kind == "vmem" else make_kv(config, kind, block_size=4)
    for seq, n in ((0, 9), (1, 3), (2, 14)):
        kv.manager.allocate(seq, n)
    kv.manager.free(1)                                 # slot / blocks reused out of order
    kv.manager.allocate(3, 6)
    kv.execute(kv.manager.take_ops())
    kv.begin_step([(2, 10, 4), (0, 0, 9), (3, 5, 1)])
    return kv, [kv.layer_view(layer) for layer in range(config.num_layers)]


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_flash_metadata_from_the_step_equals_metadata_read_from_the_device(kind):
    import dataclasses
    from vmemkv.runtime.attention import flash
    kv, views = _filled_views(kind)
    with kv:
        assert views[0].meta is views[1].meta              # one StepMeta for every layer
        by_hand = dataclasses.replace(views[0], meta=None)  # reads slots / tables from tensors
        build = flash._packed_metadata if kind == "vmem" else flash._gather_metadata
        ours, theirs = build(views[0], torch.device("cpu")), build(by_hand, torch.device("cpu"))
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert (a is None and b is None) or (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        if kind == "paged":
            assert flash._used_block_ids(views[0]) == flash._used_block_ids(by_hand)
