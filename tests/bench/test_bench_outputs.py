"""vmemkv bench's STALE.txt names exactly what the suite writes: not vmemkv bench serve's
serve.png and serve.json in the same folder ("*.png" called serve.png stale after every bench
run), and --prefix-eviction's prefix.json (never marked), which leaves the list when rewritten
after the suite's marker has finished."""
import os

from vmemkv.benchmarks import plots
from vmemkv.benchmarks.suite import OUTPUTS
from vmemkv.scheduler.result_files import STALE_NAME, StaleMarker, write_json


def _earlier_run(folder):
    for name in ("serve.json", "serve.png", "bench.json", "prefix.json", "mapper_overlap.png"):
        (folder / name).write_text("earlier")


def test_the_marker_names_the_suites_files_and_not_bench_serves(tmp_path):
    _earlier_run(tmp_path)
    marker = StaleMarker(str(tmp_path), OUTPUTS, "vmemkv bench").begin()
    assert marker.stale == ["bench.json", "mapper_overlap.png", "prefix.json"]
    marker.wrote(write_json(str(tmp_path / "bench.json"), {}))
    marker.wrote(write_json(str(tmp_path / "mapper_overlap.png"), {}))
    marker.finish()
    assert (tmp_path / STALE_NAME).read_text().splitlines()[1:] == ["prefix.json"]
    write_json(str(tmp_path / "prefix.json"), {"rows": []})   # --prefix-eviction, after the suite
    assert not (tmp_path / STALE_NAME).exists()
    assert (tmp_path / "serve.png").read_text() == "earlier"


def test_every_plot_the_suite_draws_is_one_of_its_outputs(tmp_path, monkeypatch):
    for name in ("attention_latency", "memory_utilisation", "mapper_overlap"):
        monkeypatch.setattr(plots, name, lambda data, path: path)
    written = plots.write_all({"attention": {}, "memory": {}, "alloc": {}}, str(tmp_path))
    assert len(written) == 3
    assert {os.path.basename(p) for p in written} <= set(OUTPUTS)
