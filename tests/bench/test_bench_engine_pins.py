"""Pins on the engine and mapper benchmarks' figures, from fake systems and given numbers (no
engine runs, no timing): which way each ratio goes, the median run, and each figure's unit."""
from types import SimpleNamespace

import pytest

from vmemkv.benchmarks import alloc, engine

MiB = 1 << 20
TOK_S = {"vmem per-layer": 400.0, "paged bs16": 200.0}
ITL_MS = {"vmem cpu-varlen": 10.0, "paged cpu-varlen": 25.0, "vmem sdpa": 20.0, "paged sdpa": 30.0}


class FakeSystem:
    """Stands in for EngineSystem: a fixed row, and the tokens ``options`` gives it."""

    def __init__(self, name, options, work, device, model=None):
        self.name, self.tokens, self.calls = name, options.get("tokens"), 0

    def once(self):
        self.calls += 1

    def row(self):
        return {"system": self.name, "tok_s": TOK_S.get(self.name, 1.0), "wall_s": 1.0,
                "attn": 0.5, "overhead": 0.1, "itl_p50_ms": ITL_MS.get(self.name, 1.0)}


class FakeTransformers(FakeSystem):
    def __init__(self, work, device):
        super().__init__("transformers generate_batch", {"tokens": work["hf_tokens"]}, work, device)

    def row(self):
        return {"system": self.name, "tok_s": 100.0}


def test_engine_rows_compare_tokens_with_vmem_and_speed_with_transformers(monkeypatch):
    monkeypatch.setattr(engine, "EngineSystem", FakeSystem)
    monkeypatch.setattr(engine, "TransformersSystem", FakeTransformers)
    configs = [("vmem per-layer", {"tokens": [[1, 2], [3, 4]]}),
               ("paged bs16", {"tokens": [[1, 2], [3, 5]]})]
    rows = engine.measure_systems({"hf_tokens": [[9], [3, 4]]}, configs, "cpu", 2, packed=False)
    assert [(r["system"], r["agree"], r["vs_hf"]) for r in rows] == [
        ("vmem per-layer", 1.0, 4.0), ("paged bs16", 0.5, 2.0),
        ("transformers generate_batch", 0.5, 1.0)]


def test_an_engine_row_is_its_median_run_with_kv_in_mib_and_itl_in_ms():
    def stats(wall_s, tok_s, itl_s):
        return SimpleNamespace(wall_s=wall_s, tokens_per_s=tok_s, steps=7, cache_bytes=3 * MiB,
                               kv_usage_peak=0.5, mapping_s=0.002, mapping_share=0.01,
                               attention="cpu-varlen", serving={}, overhead_share=0.1,
                               itl_s=itl_s, step_split=lambda: {"attention": 0.25})
    system = object.__new__(engine.EngineSystem)
    system.name, system.engine = "vmem per-layer", SimpleNamespace(close=lambda: None)
    system.runs = [stats(3.0, 10.0, [0.009]), stats(1.0, 30.0, [0.001]),
                   stats(2.0, 20.0, [0.001, 0.003, 0.002])]
    row = system.row()
    assert (row["wall_s"], row["tok_s"], row["tok_s_runs"]) == (2.0, 20.0, [10.0, 30.0, 20.0])
    assert row["kv_MiB"] == 3.0 and row["map_ms"] == 2.0 and row["attn"] == 0.25
    assert row["itl_p50_ms"] == pytest.approx(2.0)


def test_long_prompt_ratio_is_paged_itl_over_vmem_itl_per_backend(monkeypatch, capsys):
    monkeypatch.setattr(engine, "EngineSystem", FakeSystem)
    monkeypatch.setattr(engine, "kv_budget_bytes", lambda model, work, configs: MiB)
    monkeypatch.setattr(engine, "_model", lambda device: None)
    result = engine.long_prompts("cpu", repeats=1)
    assert result["paged_over_vmem_itl"] == {"cpu-varlen": 2.5, "sdpa": 1.5}
    assert "paged ITL / vmem ITL: cpu-varlen 2.50x  sdpa 1.50x" in capsys.readouterr().out


def test_the_engine_summary_is_vmem_tokens_per_s_over_paged_and_transformers(monkeypatch):
    rows = [{"system": name, "tok_s": tok_s} for name, tok_s in (
        ("vmem per-layer", 400.0), ("paged bs16", 200.0), ("transformers generate_batch", 50.0))]
    monkeypatch.setattr(engine, "measure_systems", lambda *a, **k: rows)
    monkeypatch.setattr(engine, "kv_budget_bytes", lambda model, work, configs: MiB)
    monkeypatch.setattr(engine, "_model", lambda device: None)
    summary = engine.run(quick=True)["summary"]
    assert summary == {"engine_vs_transformers": 8.0, "vmem_vs_paged": 2.0}


def test_the_mapper_rows_are_the_median_of_their_samples():
    def sample(mode, wait_ms):
        return {"mode": mode, "mapping_ms": wait_ms, "wait_ms": wait_ms, "loop_ms": 100.0}
    runs = {False: [sample("inline", w) for w in (40.0, 10.0, 20.0)],
            True: [sample("background", w) for w in (5.0, 15.0, 10.0)]}
    inline, background = alloc.mapper_rows(runs, {"layers": 2, "batch": 4, "page_bytes": 64 << 10})
    assert (inline["wait_ms"], inline["wait_ms_min"], inline["wait_ms_max"]) == (20.0, 10.0, 40.0)
    assert (background["wait_ms"], background["wait_saved_pct"]) == (10.0, 50.0)


def test_a_ctrl_c_in_a_section_draws_no_plots_and_marks_the_old_ones_stale(tmp_path, monkeypatch):
    from vmemkv.benchmarks import suite

    def call(section, quick, device, progress, options=None):
        if section == "memory":
            raise KeyboardInterrupt
        return {"results": []}
    drawn = []
    monkeypatch.setattr(suite, "_call", call)
    monkeypatch.setattr(suite, "_plots", lambda payload, out_dir, on_written: drawn.append(out_dir))
    (tmp_path / "memory_utilisation.png").write_bytes(b"an earlier run's plot")
    with pytest.raises(KeyboardInterrupt, match="finished: alloc$"):
        suite.run_suite(out_dir=str(tmp_path), device="cpu", sections=("alloc", "memory"),
                        progress=False)
    assert drawn == []
    stale = (tmp_path / "STALE.txt").read_text()
    assert "memory_utilisation.png" in stale and "(interrupted)" in stale
