"""Fixes for benchmark bugs a hunt reproduced (one test per bug)."""
import pytest

from vmemkv.scheduler.result_files import streamed_open


def test_streamed_open_leaves_a_folder_named_like_its_partial_file_alone(tmp_path):
    """A folder named bench.log.partial could not be opened, yet the finally renamed it onto
    bench.log; now only a file this call opened is renamed, and the earlier log stays."""
    (tmp_path / "bench.log").write_text("earlier run\n")
    folder = tmp_path / "bench.log.partial"
    folder.mkdir()
    (folder / "keep").write_text("user's file")
    with pytest.raises(IsADirectoryError):
        with streamed_open(str(tmp_path / "bench.log")):
            pass
    assert (folder / "keep").read_text() == "user's file"
    assert (tmp_path / "bench.log").read_text() == "earlier run\n"


@pytest.mark.parametrize("module", ["yardstick", "attention"])
@pytest.mark.parametrize("device, message", [
    ("bogus", "argument --device: invalid choice: 'bogus'"),
    ("cuda", "--device cuda: no CUDA device is visible to torch here")])
def test_a_device_mistake_is_one_usage_line_not_a_traceback(module, device, message,
                                                            monkeypatch, capsys):
    """yardstick.py and attention.py took any --device and failed deep in torch with a
    traceback; now, like alloc.py, argparse's one line and exit 2, before anything runs."""
    import importlib

    import torch
    bench = importlib.import_module(f"vmemkv.benchmarks.{module}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench.yardstick if module == "attention" else bench, "measure",
                        lambda *a, **k: pytest.fail("measured despite the bad --device"))
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", device, *(["--quick"] if module == "attention" else ["--mib", "1"])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("content, message", [
    (None, "missing.json: No such file or directory"),
    ("{bad", "missing.json: not JSON (Expecting property name"),
    ('{"results": []}', "missing.json: not a bench.json written by vmemkv bench")])
def test_the_plots_cli_refuses_a_file_that_is_not_a_bench_json_in_one_line(
        content, message, tmp_path, capsys):
    """A missing or malformed file was a traceback; another benchmark's JSON drew nothing and
    said nothing. Now each is argparse's one line, exit 2."""
    from vmemkv.benchmarks import plots
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        plots.main([str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else ["missing.json"])


def test_the_plots_cli_says_when_no_plot_had_data(tmp_path, capsys):
    import json

    from vmemkv.benchmarks import plots
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"benchmark": "vmemkv bench", "attention": {"error": "x"}}))
    assert plots.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# no plots: ") and str(path) in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
