"""LoRA workloads and the simulator with adapters (issue 31): S-LoRA's synthetic setting, a
unified pool against a static split."""
import hashlib
import json
from collections import Counter
from dataclasses import replace

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import (LORA_RANKS, LoraSpec, WorkloadSpec, adapter_rank,
                                       generate, lora_adapter_bytes, lora_workload,
                                       make_adapters, parse_trace_object, write_trace)

LLAMA = get_model("llama-3-8b")
R64 = lora_adapter_bytes(LLAMA, 64)


def test_adapter_bytes_follow_the_q_k_v_o_shapes():
    # Llama-3-8B: hidden 4096, q_out 4096, kv_out 1024 (GQA): 26,624 r per layer, 32 layers, fp16
    assert lora_adapter_bytes(LLAMA, 1) == 26_624 * 32 * 2
    assert R64 == 109_051_904 == 64 * lora_adapter_bytes(LLAMA, 1)
    # a Llama-7B (MHA: kv_out = 4096) rank-64 adapter on q, k, v, o: 4 x 2 x 4096 x 64 x 32 x 2
    llama7b = replace(LLAMA, num_kv_heads=32)
    assert lora_adapter_bytes(llama7b, 64) == 128 * 2**20
    with pytest.raises(ConfigError, match="no LoRA shapes"):
        lora_adapter_bytes(get_model("tiny"), 8)


def test_adapters_have_ranks_from_the_set_names_and_digests():
    adapters = make_adapters(LoraSpec(200, seed=4), LLAMA)
    assert len({a.name for a in adapters}) == 200 and adapters[0].name == "lora-0000"
    assert all(a.digest == hashlib.sha256(a.name.encode()).hexdigest() for a in adapters)
    ranks = Counter(adapter_rank(a, LLAMA) for a in adapters)
    assert set(ranks) == set(LORA_RANKS) and min(ranks.values()) > 30   # ~50 each


def test_popularity_is_zipf():
    spec = WorkloadSpec(num_requests=6000, arrival_rate=10.0, seed=1)
    counts = Counter(e.adapter.name for e in lora_workload(spec, LoraSpec(100), LLAMA))
    top = [counts[f"lora-{i:04d}"] for i in range(3)]
    harmonic = sum(1 / (i + 1) for i in range(100))
    assert top[0] / 6000 == pytest.approx(1 / harmonic, rel=0.1)      # 19.3%
    assert top[0] / top[1] == pytest.approx(2, rel=0.2)
    assert top[0] / top[2] == pytest.approx(3, rel=0.2)
    flat = Counter(e.adapter.name for e in lora_workload(spec, LoraSpec(100, 0.0), LLAMA))
    assert max(flat.values()) < 3 * 60                                  # uniform: ~60 each


def test_the_workload_is_seeded_and_keeps_the_lengths():
    spec = WorkloadSpec(num_requests=300, arrival_rate=5.0, seed=2)
    a = lora_workload(spec, LoraSpec(50, seed=7), LLAMA)
    assert a == lora_workload(spec, LoraSpec(50, seed=7), LLAMA)
    assert a != lora_workload(spec, LoraSpec(50, seed=8), LLAMA)
    assert [replace(e, adapter=None) for e in a] == generate(spec)


def test_a_trace_keeps_its_adapters(tmp_path):
    entries = lora_workload(WorkloadSpec(num_requests=20, seed=3), LoraSpec(5), LLAMA)
    path = tmp_path / "lora.jsonl"
    write_trace(str(path), entries)
    lines = path.read_text().splitlines()
    assert [parse_trace_object(json.loads(line), "t") for line in lines] == entries
    with pytest.raises(ConfigError, match="adapter_bytes"):
        parse_trace_object({"prompt_len": 1, "output_len": 1, "adapter": "x"}, "t")


# --- the simulator --------------------------------------------------------------------------

SMALL = WorkloadSpec(num_requests=120, arrival_rate=20.0, seed=5)
CACHE = 3 * 10**9


def sim(entries, **kw):
    kw.setdefault("cache_bytes", CACHE)
    kw.setdefault("scheduler", SchedulerConfig(watermark=0.01))
    return simulate(entries, SimConfig(**kw))


@pytest.fixture(scope="module")
def runs():
    entries = lora_workload(SMALL, LoraSpec(40), LLAMA)
    return entries, {
        "unified": sim(entries),
        "static": sim(entries, adapter_budget_bytes=3 * R64),      # room for 3 rank-64 adapters
        "slow": sim(entries, h2d_bytes_per_s=1e9),
    }


def test_every_request_finishes(runs):
    entries, results = runs
    want = sum(e.output_len for e in entries)
    for r in results.values():
        assert r.num_requests == len(entries) and r.output_tokens == want
        assert r.adapter_loads >= len({e.adapter.digest for e in entries}) > 0
        assert r.adapter_load_bytes > 0 and r.peak_adapters_resident >= 1


def test_loads_are_charged_at_the_host_to_device_bandwidth(runs):
    _, r = runs
    fast, slow = r["unified"], r["slow"]
    assert fast.adapter_load_seconds == pytest.approx(fast.adapter_load_bytes / 25e9)
    assert slow.adapter_load_seconds == pytest.approx(slow.adapter_load_bytes / 1e9)
    assert slow.simulated_seconds > fast.simulated_seconds
    assert fast.adapter_read_seconds > 0       # the batch's adapters read each step


def test_the_unified_pool_keeps_more_adapters_resident_than_a_tight_split(runs):
    _, r = runs
    unified, static = r["unified"], r["static"]
    assert unified.mean_adapters_resident > static.mean_adapters_resident
    assert static.peak_adapter_pages * 2 * 2**20 <= 3 * R64 + 2 * 2**20   # inside its region
    assert unified.adapter_loads < static.adapter_loads


def test_config_refuses_a_split_without_kv():
    with pytest.raises(ConfigError, match="adapter_budget_bytes"):
        SimConfig(cache_bytes=10**9, adapter_budget_bytes=10**9)
    with pytest.raises(ConfigError, match="h2d_bytes_per_s"):
        SimConfig(h2d_bytes_per_s=0)


# --- vmemkv simulate ------------------------------------------------------------------------

LORA_CLI = ["simulate", "--requests", "40", "--cache-gb", "3", "--no-progress", "--json",
            "--arrival-rate", "10", "--lora-adapters", "20"]


def test_the_cli_runs_adapters_unified_and_split(capsys):
    from vmemkv.cli import main
    assert main(LORA_CLI) == 0
    unified = json.loads(capsys.readouterr().out)
    assert main(LORA_CLI + ["--lora-budget-gb", "0.5", "--h2d-gbps", "5"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert unified["adapter_loads"] > 0 and unified["config"]["lora_budget_gb"] is None
    assert split["adapter_load_seconds"] == pytest.approx(split["adapter_load_bytes"] / 5e9)
    assert split["peak_adapter_pages"] * 2 * 2**20 <= 0.5e9


def test_the_table_shows_the_adapters_of_a_lora_run_only(capsys):
    from vmemkv.cli import main
    assert main([a for a in LORA_CLI if a != "--json"]) == 0
    table = capsys.readouterr().out
    loads = int(next(line for line in table.splitlines()
                     if line.strip().startswith("adapter loads")).split()[-1].replace(",", ""))
    assert loads > 0 and "adapters resident mean / peak" in table
    assert main(["simulate", "--requests", "20", "--cache-gb", "20"]) == 0
    assert "adapter" not in capsys.readouterr().out


def test_the_cli_refuses_a_split_without_adapters_or_kv(capsys):
    from vmemkv.cli import main
    assert main(["simulate", "--lora-budget-gb", "1", "--no-progress"]) == 2
    assert "--lora-adapters" in capsys.readouterr().err
    assert main(LORA_CLI + ["--lora-budget-gb", "3"]) == 2
    assert "leaves no KV memory" in capsys.readouterr().err
