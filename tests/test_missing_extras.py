"""A module of an optional extra that is not installed is one line naming the extra to install,
never a traceback (vmemkv generate / calibrate / serve / bench printed a 16-21-line
ModuleNotFoundError; bench serve crashed after its load test; sweep drew no plots and said
nothing). Each import is made to fail in-process: ``sys.modules[name] = None``."""
import sys
from pathlib import Path

import pytest

from vmemkv import cli
from vmemkv.cli import main

ROOT = Path(__file__).resolve().parents[1]
# vmemkv.runtime.engine needs transformers at import time through these (engine/config.py
# imports kv_calibration, which imports transformers): dropped from sys.modules so the next
# import runs them again and fails; monkeypatch puts the loaded modules back afterwards
ENGINE_CHAIN = ("vmemkv.runtime.engine", "vmemkv.runtime.engine.config",
                "vmemkv.runtime.kv_calibration")


@pytest.fixture
def without(monkeypatch):
    """``without(*modules)``: those modules cannot be imported for the rest of the test."""
    def hide(*modules: str) -> None:
        for name in modules:
            monkeypatch.setitem(sys.modules, name, None)
        for name in ENGINE_CHAIN:
            monkeypatch.delitem(sys.modules, name, raising=False)
    return hide


def test_every_extra_named_is_an_extra_of_pyproject():
    tomllib = pytest.importorskip("tomllib")      # Python 3.11+
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    named = {extra for spec in cli.EXTRA_OF_MODULE.values() for extra in spec.split(",")}
    assert named <= extras, named - extras


def test_missing_extra_names_the_extra_of_a_module_and_nothing_else():
    assert cli.missing_extra(ModuleNotFoundError("x", name="matplotlib.pyplot")) == \
        "matplotlib is not installed: pip install 'vmemkv[bench]'"
    assert cli.missing_extra(ModuleNotFoundError("x", name="gguf")) == \
        "gguf is not installed: pip install 'vmemkv[hf,real]'"
    assert cli.missing_extra(ModuleNotFoundError("x", name="torch")) is None     # not an extra's
    assert cli.missing_extra(ImportError("cannot import name", name="transformers")) is None
    assert cli.missing_extra(ValueError("transformers")) is None


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "tiny-llama", "--max-new-tokens", "2"],
    ["calibrate", "--model", "tiny-llama", "--out", "{tmp}/profile.json"],
    ["serve", "--model", "tiny-llama", "--port", "0"],
], ids=lambda argv: argv[0])
def test_a_command_without_the_hf_extra_names_it_in_one_line(argv, without, tmp_path, capsys):
    without("transformers")
    code = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"vmemkv {argv[0]}: error: transformers is not installed: "
                   f"pip install 'vmemkv[hf]'\n")
    assert not (tmp_path / "profile.json").exists()


def test_serve_without_either_extra_names_the_serve_extra_first(without, capsys):
    without("transformers", "fastapi")
    code = main(["serve", "--model", "tiny-llama", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("vmemkv serve: error: ServeConfigError: serving needs the 'serve' "
                          "extra (FastAPI, uvicorn): pip install 'vmemkv[serve]'")
    assert "transformers" not in err and err.count("\n") == 1


def test_bench_engine_section_without_the_hf_extra_is_refused_before_any_section(
        without, tmp_path, capsys):
    without("transformers")
    code = main(["bench", "--smoke", "--only", "alloc", "engine", "--no-progress",
                 "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2
    assert err == ("vmemkv bench: error: transformers is not installed: pip install "
                   "'vmemkv[hf]' (engine needs it; --only alloc runs without it)\n")
    assert out == "" and not (tmp_path / "out").exists()     # no section ran


def test_bench_serve_without_matplotlib_skips_the_plot_after_writing_serve_json(
        without, tmp_path, capsys, monkeypatch):
    from vmemkv.runtime.serve import bench_client
    from vmemkv.scheduler.report import RequestTiming

    async def load(url, model, requests):      # two requests answered, no server needed
        return [RequestTiming(0.0, (0.01, 0.02), 4), RequestTiming(0.1, (0.12, 0.15), 4)], [], 0.2
    monkeypatch.setattr(bench_client, "run_load", load)
    without("matplotlib")
    code = main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model", "m", "--rate", "8",
                 "--num-prompts", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.endswith("\n# plots skipped: matplotlib is not installed: pip install "
                        "'vmemkv[bench]'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.json"]


SWEEP_SPEC = """
[base]
requests = 4
cache_gb = 1
[grid]
policy = ["paged"]
"""


def test_sweep_without_matplotlib_says_the_plots_were_skipped(without, tmp_path, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text(SWEEP_SPEC)
    without("matplotlib")
    code = main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--jobs", "1",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "# plots skipped: matplotlib is not installed: pip install 'vmemkv[bench]'\n" in out
    assert not list((tmp_path / "out").glob("*.png"))
    assert (tmp_path / "out" / "sweep.csv").exists()


def test_sweep_help_says_the_pngs_need_matplotlib(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert "the PNGs (with matplotlib, the bench extra)" in " ".join(capsys.readouterr().out.split())


def test_gguf_hint_works_outside_the_checkout(monkeypatch, tmp_path):
    import importlib.util

    from vmemkv.runtime import gguf
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(gguf.GgufError) as raised:
        gguf._require_extra()
    assert str(raised.value) == "reading GGUF files needs gguf: pip install 'vmemkv[hf,real]'"
