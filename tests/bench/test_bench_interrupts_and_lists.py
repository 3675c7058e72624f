"""Ctrl-C in the bench commands, and list flags given a value twice.

- ``vmemkv bench``: a Ctrl-C while the plots are drawn keeps the PNGs already rewritten in
  bench.json's ``plots`` and out of STALE.txt (they were marked only once every plot was done).
- ``python -m vmemkv.benchmarks.attention``: a list flag with a repeated value (``--batches 1 1``
  timed the same point twice) is refused in one line, exit 2, before anything runs; a Ctrl-C is
  exit 130 and one line (it was a traceback), --out written whole or not at all.
No timing: the sections, plots and measurements are stand-ins.
"""
from __future__ import annotations

import json

import pytest

from vmemkv.benchmarks import attention, plots, suite
from vmemkv.cli import INTERRUPTED_EXIT
from vmemkv.scheduler.result_files import STALE_NAME, write_atomic


def test_a_ctrl_c_after_the_first_png_keeps_it_in_plots_and_out_of_stale(tmp_path, monkeypatch):
    for name in ("memory_utilisation.png", "mapper_overlap.png"):   # an earlier run's
        (tmp_path / name).write_bytes(b"earlier run")

    def rewritten(data, path):
        return write_atomic(path, lambda tmp: open(tmp, "wb").write(b"this run"))

    def ctrl_c(data, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "_call", lambda section, *args, **kwargs: {"results": []})
    monkeypatch.setattr(plots, "memory_utilisation", rewritten)   # drawn first, then alloc's
    monkeypatch.setattr(plots, "mapper_overlap", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        suite.run_suite(out_dir=str(tmp_path), device="cpu", sections=("alloc", "memory"),
                        progress=False)
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["interrupted"] is True
    assert payload["plots"] == [str(tmp_path / "memory_utilisation.png")]
    assert (tmp_path / "memory_utilisation.png").read_bytes() == b"this run"
    assert (tmp_path / "mapper_overlap.png").read_bytes() == b"earlier run"
    stale = (tmp_path / STALE_NAME).read_text().splitlines()
    assert stale[1:] == ["mapper_overlap.png"]   # only the one this run did not rewrite


@pytest.mark.parametrize("flag, values, repeated", [
    ("--batches", ["1", "8", "1"], "1"),
    ("--batches", ["1", "01"], "1"),
    ("--contexts", ["64", "64"], "64"),
    ("--configs", ["8x2048", "1x64", "8x2048"], "8x2048"),
    ("--phases", ["decode", "decode"], "decode"),
    ("--vmem-layout", ["interleaved", "interleaved"], "interleaved"),
    ("--dtype", ["float32", "float32"], "float32"),
    ("--kv-cache-dtype", ["auto", "bf16", "auto"], "auto"),
    ("--baselines", ["sdpa", "sdpa"], "sdpa"),
])
def test_a_list_flag_given_a_value_twice_is_one_line_exit_2_before_anything_runs(
        flag, values, repeated, monkeypatch, capsys):
    measured = []
    monkeypatch.setattr(attention, "measure", lambda args, progress=None: measured.append(args))
    with pytest.raises(SystemExit) as exit_info:
        attention.main(["--device", "cpu", flag, *values])
    assert exit_info.value.code == 2 and measured == []
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.rstrip("\n").endswith(
        f": error: argument {flag}: {repeated} is given twice; give each value once")


def test_distinct_list_values_are_kept_in_order():
    args = attention.parse_args(["--device", "cpu", "--configs", "8x2048", "1x64",
                                 "--batches", "8", "1", "--baselines"])
    assert args.configs == [(8, 2048), (1, 64)] and [str(c) for c in args.configs] == ["8x2048", "1x64"]
    assert args.batches == [8, 1] and args.baselines == []


def run_main(argv) -> int:
    try:
        return attention.main(argv)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped attention.main (a traceback)")


def test_a_ctrl_c_while_measuring_is_exit_130_one_line_and_no_json(tmp_path, monkeypatch, capsys):
    out = tmp_path / "attention.json"

    def ctrl_c(args, progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(attention, "measure", ctrl_c)
    assert run_main(["--device", "cpu", "--out", str(out)]) == INTERRUPTED_EXIT
    assert capsys.readouterr().err == f"attention: interrupted; {out} not written\n"
    assert list(tmp_path.iterdir()) == []


class InterruptedWhileDumped(dict):
    """A payload whose JSON is cut short by a Ctrl-C part way through (json.dump reads items())."""

    def items(self):
        yield "results", []
        raise KeyboardInterrupt


def test_a_ctrl_c_while_writing_the_json_leaves_the_earlier_file_whole(tmp_path, monkeypatch, capsys):
    out = tmp_path / "attention.json"
    out.write_text('{"earlier": "run"}')
    monkeypatch.setattr(attention, "measure", lambda args, progress=None: InterruptedWhileDumped(results=[]))
    assert run_main(["--device", "cpu", "--out", str(out)]) == INTERRUPTED_EXIT
    assert capsys.readouterr().err == "attention: interrupted\n"
    assert list(tmp_path.iterdir()) == [out] and json.loads(out.read_text()) == {"earlier": "run"}
