"""LoRA adapters under tensor parallelism (CPU, gloo): every rank holds its slice of each adapter
in its own pool (rank 0 sends the host copy with the plan that loads it; each rank cuts its
slice), B's rows of column-parallel projections and A's columns of row-parallel ones, applied
before the ranks' sum.
Mixed batches under preemption, with adapters evicted for KV and loaded again, give PEFT's
merged models' tokens; every rank holds the same adapters and a follower keeps host copies of
the resident ones only."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

peft = pytest.importorskip("peft")

from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.lora import LoraAdapter  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

from ..engine.conftest import prompts, tokens  # noqa: E402
from ..engine.test_lora_engine import ADAPTERS, CACHES, base, greedy, make_adapter, merged  # noqa: E402

FAMILY = "tiny-llama"
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-adapters")
    return {name: make_adapter(FAMILY, root / name, *spec) for name, spec in ADAPTERS.items()}


# the mixed batch: 8 prompts of 3 to 30 tokens, each with one of the three adapters or none
BATCH, NAMES = prompts(8, 3, 30, seed=11), [None, "a4", "b8", "c16"] * 2


@pytest.fixture(scope="module")
def peft_tokens(adapter_dirs):
    """PEFT's merged models' greedy tokens for BATCH (each prompt on its adapter's model), once
    for both caches' runs."""
    return [greedy(base(FAMILY) if n is None else merged(FAMILY, adapter_dirs[n]), p, NEW_TOKENS)
            for p, n in zip(BATCH, NAMES)]


def slice_bytes(shard, path) -> int:
    """The bytes a rank's slice of the adapter at ``path`` takes: per targeted module, A as
    [r, the shard's input columns] and B as [the shard's output rows, r], in the module's dtype,
    each padded to 64 bytes (runtime/lora/weights.py's layout)."""
    import json
    config = json.loads((Path(path) / "adapter_config.json").read_text())
    total = 0
    for name, module in shard.named_modules():
        if name.rsplit(".", 1)[-1] not in config["target_modules"]:
            continue
        weight = getattr(module, "partial_linear", module).weight    # [out rows, in columns]
        for numel in (config["r"] * weight.shape[1], weight.shape[0] * config["r"]):
            total += -(-numel * weight.dtype.itemsize // 64) * 64
    return total


@pytest.mark.parametrize("cache, preemption", [("vmem", "swap"), ("paged", "recompute")])
def test_tp2_mixed_adapters_under_preemption_match_peft_and_every_rank_holds_the_same(
        cache, preemption, adapter_dirs, peft_tokens):
    # per rank: the three adapters take 130 KiB while they run (whole, on every rank), the KV
    # of 8 sequences of up to 70 tokens half of one process's: preemptions and evictions
    batch, names = [list(p) for p in BATCH], NAMES
    with Engine(build_model(FAMILY, seed=0), max_batch=8, max_context=128, **CACHES[cache],
                tensor_parallel_size=2, cache_bytes=136 * 1024, preemption=preemption,
                swap_bytes=1 << 20 if preemption == "swap" else 0, check_integrity=True) as engine:
        for name, path in adapter_dirs.items():
            engine.add_lora(name, path)
        out = engine.generate(batch, [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                     lora=n) for n in names])
        stats = engine.kv.manager.adapter_stats()
        preemptions = engine.scheduler.metrics.num_preemptions
        states = engine.tp.memory_states()
        held = {name: engine.adapters.ref(name).num_bytes for name in adapter_dirs}
        slices = {name: slice_bytes(engine.runner.model, path) for name, path in adapter_dirs.items()}
    assert tokens(out) == peft_tokens
    # each rank holds its slice: 79% (a4, attention only) to 76% of the whole adapter at TP=2
    whole = {name: LoraAdapter.load(path, base(FAMILY)).num_bytes
             for name, path in adapter_dirs.items()}
    assert held == slices and all(held[n] < 0.8 * whole[n] for n in held)
    assert stats.evictions > 0 and stats.loads > 3 and preemptions > 0
    resident = states[0]["resident_adapters"]
    assert len(resident) == stats.resident > 0
    assert states[1]["resident_adapters"] == resident            # the same pool pages
    assert states[1]["adapter_host_copies"] == sorted(resident)  # evicted ones dropped


def test_a_follower_that_raises_is_named_with_its_error_in_rank_0s(monkeypatch, adapter_dirs):
    """Rank 0 (patched, this process) sends a plan that loads an adapter without its host copy:
    rank 1 raises and exits, and the step's TensorParallelError says what rank 1 raised (before,
    only that the activation sum lost its peer)."""
    from vmemkv.runtime.distributed import TensorParallelError, launch
    monkeypatch.setattr(launch, "adapter_upload", lambda plan, host_copy: None)
    engine = Engine(build_model(FAMILY, seed=0), max_batch=2, max_context=64,
                    tensor_parallel_size=2, self_check=False)
    engine.add_lora("a4", adapter_dirs["a4"])
    with pytest.raises(TensorParallelError, match=r"rank 1: LoraBatchError: adapter [0-9a-f]{12} "
                                                  r"loaded with no weights"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, lora="a4"))
    assert not multiprocessing.active_children()     # the engine closed itself and its ranks
    engine.close()


def test_a_model_that_served_adapters_on_one_process_serves_them_sharded(adapter_dirs):
    """The single-process engine leaves its (inert) LoRA hooks on the model; the shards copy
    them with the model, on projections the shards replace. Before, the shards reused those
    copied hooks and ran the base model for every adapter's rows."""
    model = build_model(FAMILY, seed=0)
    prompt, params = [5, 9, 17, 33, 65], SamplingParams(max_new_tokens=8, lora="b8")
    expected = [greedy(merged(FAMILY, adapter_dirs["b8"]), prompt, 8)]
    for world in (1, 2):
        with Engine(model, max_batch=2, max_context=64, tensor_parallel_size=world) as engine:
            engine.add_lora("b8", adapter_dirs["b8"])
            assert tokens(engine.generate([prompt], params)) == expected, f"TP={world}"


def test_add_lora_checks_host_memory_for_a_copy_on_every_rank(monkeypatch, adapter_dirs):
    """Every rank holds the adapter's host copy (rank 0 sends it with the plan that loads it),
    so two ranks need twice one process's bytes: refused when only one copy fits."""
    from safetensors.torch import load_file

    from vmemkv.runtime import memory
    from vmemkv.runtime.lora import LoraMemoryError
    file = Path(adapter_dirs["a4"]) / "adapter_model.safetensors"
    one = file.stat().st_size + 4 * sum(t.numel() for t in load_file(file).values())
    with Engine(build_model(FAMILY, seed=0), max_batch=2, max_context=64,
                tensor_parallel_size=2, self_check=False) as engine:
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 2 * one - 1)
        with pytest.raises(LoraMemoryError, match=f"needs {2 * one} bytes .* x 2 processes"):
            engine.add_lora("a4", adapter_dirs["a4"])
        assert engine.adapters.names == []
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 2 * one)
        engine.add_lora("a4", adapter_dirs["a4"])
        assert engine.adapters.names == ["a4"]
