"""Hunt 31, benchmarks: ``--smoke`` shrinks every workload it runs, and the standalone timing
benchmarks whose figures are ratios of wall times say when the machine was busy."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from vmemkv.benchmarks import beam, common, prefix, simulate, smoke, tp

BUSY, IDLE = (8.0, 8.0, 8.0), (0.0, 0.0, 0.0)


def _load(monkeypatch, loads) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: loads)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


def test_smoke_shrinks_the_prefix_eviction_workload(monkeypatch):
    # vmemkv bench --smoke --prefix-eviction lru ran prefix.QUICK's 4 chats of 3 turns: 2 minutes
    smoke.apply(monkeypatch.setattr)
    work = prefix.workload(quick=True)
    chats, turns = len(work["users"][0]), len(work["users"])
    assert (chats, turns) == (2, 2)
    assert work["max_batch"] == 2 and work["answer"] == 4
    # the system prompt still fills whole blocks of 16, so retention has something to share
    assert len(work["system"]) == 32
    assert work["max_context"] == 32 + 2 * (8 + 4) + 16


def _fake_prefix_rows(quick, device, warmup, repeats, policies=None):
    return [{"cache": "vmem", "eviction": "off", "seconds": 2.0, "speedup": 1.0,
             "hit_rate": 0.0, "computed": 10, "tokens_equal": True}]


@pytest.mark.parametrize("loads, warned", [(BUSY, 1), (IDLE, 0)])
def test_prefix_json_and_output_carry_the_busy_machine_warning(monkeypatch, tmp_path, capsys,
                                                               loads, warned):
    _load(monkeypatch, loads)
    monkeypatch.setattr(prefix, "run", _fake_prefix_rows)
    out = tmp_path / "prefix.json"
    assert prefix.main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert len(payload["warnings"]) == warned
    assert payload["environment"]["load_1min"] == loads[0]
    printed = capsys.readouterr().out
    assert printed.count("# WARNING: the machine was busy") == warned
    if warned:
        assert "8.00 >= 0.5 x 2 cores" in payload["warnings"][0]


class _FakeConfig:
    def __init__(self, tp_size, threads, model, prompts, new, tp_devices=None):
        self.threads, self.tokens = threads, [[1, 2]] * len(prompts)
        self.engine = SimpleNamespace(close=lambda: None)

    def once(self) -> None:
        pass

    def row(self) -> dict:
        return {"system": f"x{self.threads}", "tok_s": 10.0 * self.threads, "wall_s": 1.0,
                "comm_share": 0.25, "collectives_per_step": 2.0,
                "threads_per_rank": self.threads, "kv_MiB_per_rank": 1.0}


def test_tp_json_carries_the_busy_machine_warning(monkeypatch, tmp_path):
    from vmemkv.runtime import models
    _load(monkeypatch, BUSY)
    text = SimpleNamespace(vocab_size=256)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(tp, "_Config", _FakeConfig)
    out = tmp_path / "tp.json"
    payload = tp.run(quick=True, out=str(out), cores=2, restarts=False)
    assert len(payload["warnings"]) == 1 and "busy" in payload["warnings"][0]
    assert json.loads(out.read_text())["warnings"] == payload["warnings"]


def test_busy_warnings_judges_the_higher_of_the_start_and_end_loads(monkeypatch, capsys):
    _load(monkeypatch, IDLE)
    assert len(common.busy_warnings(1.5)) == 1          # busy when it began, idle at the end
    assert common.busy_warnings(0.2) == []
    assert capsys.readouterr().out.count("# WARNING") == 1


@pytest.mark.parametrize("main, argv, wrong", [
    (prefix.main, ["--trace", "2", "--cache-gb", "1000"], "--cache-gb 1000 plus llama-3-8b's"),
    (prefix.main, ["--trace", "2", "--cache-gb", "60", "0.001"], "--cache-gb 0.001 cannot hold"),
    (simulate.main, ["--repeats", "1", "--cache-gb", "0.001"], "--cache-gb 0.001 cannot hold"),
    (simulate.main, ["--repeats", "1", "--cache-gb", "1000"], "--cache-gb 1000 plus llama-3-8b's"),
    (beam.main, ["--simulate", "10", "--cache-gb", "1000"], "--cache-gb 1000 plus llama-3-8b's"),
    (beam.main, ["--simulate-memory", "5", "--cache-gb", "0.001"], "--cache-gb 0.001 cannot")])
def test_simulated_cache_sizes_are_refused_by_flag_before_anything_runs(capsys, main, argv,
                                                                        wrong):
    # prefix --trace and beam --simulate ran a 1000 GB cache on "one H100"; simulate printed
    # its header, then ConfigError: cache_bytes=1000000 ... (not naming the flag)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert wrong in captured.err and len(captured.err.strip().splitlines()) == 1


def test_engine_json_carries_the_busy_machine_warning(monkeypatch, tmp_path):
    from vmemkv.benchmarks import engine
    _load(monkeypatch, BUSY)
    rows = [{"system": s, "tok_s": t} for s, t in (("vmem per-layer", 20.0), ("paged bs16", 10.0),
                                                    ("transformers", 5.0))]
    monkeypatch.setattr(engine, "_model", lambda device: None)
    monkeypatch.setattr(engine, "kv_budget_bytes", lambda model, work, configs: 2**20)
    monkeypatch.setattr(engine, "measure_systems", lambda *a, **k: rows)
    payload = engine.run(quick=True, out=str(tmp_path / "engine.json"))
    assert payload["summary"] == {"engine_vs_transformers": 4.0, "vmem_vs_paged": 2.0}
    assert len(payload["warnings"]) == 1 and "8.00 >= 0.5 x 2 cores" in payload["warnings"][0]
    assert json.loads((tmp_path / "engine.json").read_text())["warnings"] == payload["warnings"]


def test_alloc_json_carries_the_busy_machine_warning(monkeypatch, tmp_path, capsys):
    from vmemkv.benchmarks import alloc
    smoke.apply(monkeypatch.setattr)
    _load(monkeypatch, BUSY)
    payload = alloc.run(quick=True, out=str(tmp_path / "alloc.json"), pages=2, device="cpu")
    assert len(payload["warnings"]) == 1 and "8.00 >= 0.5 x 2 cores" in payload["warnings"][0]
    assert json.loads((tmp_path / "alloc.json").read_text())["warnings"] == payload["warnings"]
    assert capsys.readouterr().out.count("# WARNING: the machine was busy") == 1


@pytest.mark.parametrize("quiet", [True, False])
def test_lora_engine_json_carries_the_busy_machine_warning(monkeypatch, tmp_path, capsys, quiet):
    from vmemkv.benchmarks import lora_engine
    _load(monkeypatch, BUSY)
    payload = lora_engine.run(model_name="tiny-llama", requests=2, new_tokens=1, max_batch=2,
                              repeats=1, caches=("vmem",), quiet=quiet,
                              out=str(tmp_path / "lora.json"))
    assert payload["environment"]["load_1min"] == 8.0
    assert len(payload["warnings"]) == 1 and "8.00 >= 0.5 x 2 cores" in payload["warnings"][0]
    assert json.loads((tmp_path / "lora.json").read_text())["warnings"] == payload["warnings"]
    assert capsys.readouterr().out.count("# WARNING") == (0 if quiet else 1)


def test_a_smoke_runs_bench_json_says_smoke_not_only_quick(monkeypatch, tmp_path):
    # its toy figures were recorded as a --quick run's: environment {"quick": true}, no more
    from vmemkv.benchmarks import suite
    # an in-process `vmemkv bench --smoke` earlier in this worker applied smoke for good
    monkeypatch.setattr(suite, "SMOKE", False)
    smoke.apply(monkeypatch.setattr)
    payload = suite.run_suite(quick=True, out_dir=str(tmp_path), device="cpu",
                              sections=("memory",), plots=False, progress=False)
    written = json.loads((tmp_path / "bench.json").read_text())
    assert payload["environment"]["smoke"] is True and written["environment"]["smoke"] is True
    assert written["environment"]["quick"] is True


@pytest.mark.parametrize("loads, warned", [(BUSY, 1), (IDLE, 0)])
def test_bench_prefix_eviction_json_carries_environment_and_busy_warning(monkeypatch, tmp_path,
                                                                         loads, warned):
    """``vmemkv bench --prefix-eviction``'s prefix.json held only the device and the rows: a
    ratio of wall times with no environment nor busy-machine warning (prefix.py's own has both)."""
    from vmemkv import bench
    _load(monkeypatch, loads)
    monkeypatch.setattr(prefix, "run", _fake_prefix_rows)
    args = SimpleNamespace(device="cpu", prefix_eviction="lru", suite_out=str(tmp_path))
    bench._prefix(args, "cpu (test)")
    payload = json.loads((tmp_path / "prefix.json").read_text())
    assert payload["device"] == "cpu (test)" and payload["rows"] == _fake_prefix_rows(1, 2, 3, 4)
    assert payload["environment"]["load_1min"] == loads[0]
    assert payload["environment"]["model"] == prefix.MODEL
    assert len(payload["warnings"]) == warned
