"""vmemkv as a user installs it: one cache folder for the kernel builds and the GGUF
conversions ($XDG_CACHE_HOME was honoured by one, ignored by the other), an unwritable one
named with its fix; `vmemkv bench` without matplotlib naming the extra; the licence shipped
and declared the PEP 639 way; every data file a module names shipped in the wheel."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from vmemkv.cli import main
from vmemkv.runtime import gguf
from vmemkv.runtime.attention import native

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
needs_cc = pytest.mark.skipif(native.compiler_command() is None, reason="no C compiler")


@pytest.fixture
def home_is_a_file(tmp_path, monkeypatch):
    """~ cannot hold a cache (a file: unwritable even for root); no cache variable set."""
    (tmp_path / "home").write_text("not a folder")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VMEMKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path


def tiny_source(folder: Path, name: str) -> Path:
    source = folder / f"{name}.c"
    source.write_text(f"int {name}(void) {{ return 7; }}\n")
    return source


def test_the_cache_folder_is_the_setting_then_xdg_then_home(tmp_path, monkeypatch):
    from vmemkv.runtime.cache_dir import cache_root
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("VMEMKV_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.setenv("VMEMKV_CACHE_DIR", "")             # empty: unset
    assert cache_root() == tmp_path / "xdg" / "vmemkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == tmp_path / "home" / ".cache" / "vmemkv"
    assert gguf.cache_root is cache_root                    # one function, not a copy


@needs_cc
def test_kernel_builds_go_to_xdg_cache_home_like_the_gguf_cache(home_is_a_file, monkeypatch):
    xdg = home_is_a_file / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    lib = native.library(tiny_source(home_is_a_file, "xdg_seven"))
    assert lib.xdg_seven() == 7
    assert [p.parent for p in xdg.rglob("xdg_seven-*.so")] == [xdg / "vmemkv"]
    assert gguf.cache_root() == xdg / "vmemkv"


@needs_cc
@pytest.mark.parametrize("setting", ["unset", "a-file"])
def test_an_unwritable_kernel_cache_is_a_build_error_naming_the_setting(
        setting, home_is_a_file, monkeypatch):
    if setting == "a-file":
        (home_is_a_file / "a-file").write_text("not a folder")
        monkeypatch.setenv("VMEMKV_CACHE_DIR", str(home_is_a_file / "a-file"))
    folder = re.escape(str(home_is_a_file / ("a-file" if setting == "a-file" else "home")))
    now = ".*a-file" if setting == "a-file" else "unset"
    source = tiny_source(home_is_a_file, f"unwritable_{setting.replace('-', '_')}")
    with pytest.raises(native.KernelBuildError,
                       match=rf"the kernel cache {folder}.* cannot be used \(.+\): set "
                             rf"\$VMEMKV_CACHE_DIR \(now {now}\) to a writable folder"):
        native.library(source)
    assert not any(home_is_a_file.rglob("*.so"))


def test_bench_without_matplotlib_names_the_bench_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib: not installed
    assert main(["bench", "--smoke", "--only", "memory", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.startswith("# plots skipped")]
    assert skipped == ["# plots skipped: matplotlib is not installed: pip install 'vmemkv[bench]'"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.json", "bench.log"]


def test_bench_out_help_says_the_pngs_need_the_bench_extra(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "bench.json, bench.log and the PNGs (matplotlib: the bench extra)" in help_text


def test_the_licence_is_declared_by_spdx_and_its_text_ships():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"                # PEP 639, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty" in text
    # setuptools reads a string license and license-files from 77 on
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]


def package_folder(package: str) -> Path:
    """The source folder of ``package`` through package-dir (its longest mapped prefix)."""
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapped:
            return ROOT / mapped[prefix] / Path(*parts[cut:])
    raise AssertionError(f"{package} is not under package-dir")


def package_data() -> dict:
    """{source folder: its package-data globs}."""
    return {package_folder(package): globs
            for package, globs in PYPROJECT["tool"]["setuptools"]["package-data"].items()}


def test_every_package_data_glob_matches_a_file():
    dead = [f"{folder.name}/{glob}" for folder, globs in package_data().items()
            for glob in globs if not any(folder.glob(glob))]
    assert dead == []


def test_every_c_source_or_script_a_module_names_ships_in_the_wheel():
    """decode_kernel.py builds decode_profile.c, which the wheel did not carry: installed,
    the build failed with cc's "No such file"."""
    data = package_data()
    missing = []
    for folder in (ROOT / "benchmarks", ROOT / "runtime" / "attention"):
        modules_text = "".join(p.read_text() for p in folder.glob("*.py"))
        shipped = {p for glob in data.get(folder, []) for p in folder.glob(glob)}
        missing += [f"{folder.name}/{p.name}" for p in folder.iterdir()
                    if p.suffix in (".c", ".h", ".sh") and p.name in modules_text
                    and p not in shipped]
    assert missing == []
    assert ROOT / "benchmarks" / "decode_profile.c" in {
        p for glob in data[ROOT / "benchmarks"] for p in (ROOT / "benchmarks").glob(glob)}
