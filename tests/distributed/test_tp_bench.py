"""benchmarks/tp.py (``vmemkv bench --tp 2``): TP=2's tokens equal TP=1's, a step makes one plan
broadcast and two activation sums per layer, and engine start and close are timed with ranks
forked from the rank server and started by spawn."""
import json

import pytest

from vmemkv.benchmarks import tp
from vmemkv.runtime.models import build_model


def test_the_tp_benchmark_agrees_with_tp1_counts_collectives_and_times_start_and_close(tmp_path):
    result = tp.run(quick=True, out=str(tmp_path / "tp.json"))
    assert [r["agree"] for r in result["rows"]] == [1.0, 1.0, 1.0]
    assert [r["kv_MiB_per_rank"] for r in result["rows"]] == [16.0, 16.0, 8.0]
    summary = json.loads((tmp_path / "tp.json").read_text())["summary"]
    layers = build_model(tp.MODEL).config.num_hidden_layers
    assert summary["tp_size"] == 2 and summary["tp_collectives_per_step"] == 1 + 2 * layers
    assert all(summary[k] > 0 for k in ("tp_start_first_s", "tp_start_again_s", "tp_close_s",
                                        "tp_start_spawn_s", "tp_close_spawn_s"))
    assert summary["tp_start_spawn_over_again"] == pytest.approx(
        summary["tp_start_spawn_s"] / summary["tp_start_again_s"])
