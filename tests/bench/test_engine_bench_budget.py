"""Issue 17 item 7: the engine benchmark gives every system the same KV bytes.

On CUDA a vmem slot is whole 2 MiB pages, so left to its default the vmem cache was sized for
16,384-token slots (small-llama, fp16) (~1 GiB) against paged's 512-token ~32 MiB. Here a host cache with 2 MiB
pages stands in for CUDA: the budget is what the largest configuration needs, and every engine
is built with exactly it (transformers with as many 256-token blocks as fit in it).
"""
import pytest

pytest.importorskip("transformers")

from vmemkv.benchmarks import engine as bench  # noqa: E402
from vmemkv.runtime.engine import Engine  # noqa: E402

MiB = 2**20
CONFIGS = [("vmem 2MiB pages", dict(cache="vmem", page_bytes=2 * MiB)),
           ("vmem interleaved 2MiB", dict(cache="vmem", layout="interleaved", page_bytes=2 * MiB)),
           ("paged bs16", dict(cache="paged", block_size=16)),
           ("bg mapper", dict(cache="vmem", page_bytes=2 * MiB, background_mapper=True))]


def test_every_system_is_built_with_the_largest_configurations_kv_bytes():
    model = bench._model("cpu")
    work = dict(bench.workload(quick=True), max_batch=4)
    budget = bench.kv_budget_bytes(model, work, CONFIGS)
    bytes_per_token = 2 * 4 * 2 * 32 * 4                  # K,V x layers x kv heads x dim x fp32
    paged_need = 4 * 512 * bytes_per_token
    assert budget == 4 * 8192 * bytes_per_token > paged_need   # 2 MiB per-layer: 8,192-token slots
    work["kv_bytes"] = budget
    for _, options in CONFIGS[:3]:
        with Engine(model, max_batch=4, max_context=512, cache_bytes=budget, **options) as engine:
            assert engine.kv.manager.stats().total_tokens * bytes_per_token == budget
    assert bench.hf_num_blocks(model, budget) * 256 * bytes_per_token == budget


def test_the_cuda_configurations_share_one_budget_in_the_run(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, name, options, work, device):
            seen.append(work["kv_bytes"])
            self.name, self.tokens = name, [[1]]

        def once(self):
            pass

        def row(self):
            return {"system": self.name, "tok_s": 1.0}

    monkeypatch.setattr(bench, "EngineSystem", Recorder)
    monkeypatch.setattr(bench, "TransformersSystem", lambda work, device: Recorder("hf", {}, work, device))
    payload = bench.run(quick=True, device="cpu")
    assert len(seen) == len(bench.configurations(True, "cpu")) + 1 and len(set(seen)) == 1
    assert payload["environment"]["kv_MiB_every_system"] == seen[0] / MiB
    assert {"kernel", "vmem_driver", "load_1min"} <= payload["environment"].keys()   # as alloc's
