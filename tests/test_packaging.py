"""One import namespace: the folders vmem/, scheduler/, runtime/ and benchmarks/ install as
vmemkv.vmem, vmemkv.scheduler, vmemkv.runtime and vmemkv.benchmarks, never as generic names."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ("vmem", "scheduler", "runtime", "benchmarks")


def run_python(code: str, cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter of this venv, away from the checkout (so the repo root
    is not on sys.path, as for a user who installed vmemkv)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", GENERIC)
def test_generic_top_level_names_are_not_importable_after_install(name, tmp_path):
    result = run_python(f"import {name}", tmp_path)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, result.stderr


def test_a_foreign_scheduler_distribution_changes_nothing_of_ours(tmp_path):
    """A stand-in package named ``scheduler`` (with a ``managers`` submodule) beside vmemkv:
    ``import scheduler`` gets it, and vmemkv still runs on its own scheduler."""
    foreign = tmp_path / "site" / "scheduler"
    (foreign / "managers").mkdir(parents=True)
    (foreign / "__init__.py").write_text("FOREIGN = True\n")
    (foreign / "managers" / "__init__.py").write_text("def make_manager(*a, **k):\n    raise RuntimeError('foreign')\n")
    code = (
        "import scheduler, scheduler.managers\n"
        "assert scheduler.FOREIGN\n"
        "import vmemkv\n"
        "from vmemkv.scheduler.managers import make_manager\n"
        "from vmemkv.scheduler.simulator import SimConfig, simulate\n"
        "from vmemkv.scheduler.workload import WorkloadSpec, generate\n"
        "assert make_manager.__module__ == 'vmemkv.scheduler.managers', make_manager.__module__\n"
        "result = simulate(generate(WorkloadSpec(num_requests=20)), SimConfig(policy='paged'))\n"
        "assert result.num_requests == 20 and result.output_tokens > 0, result\n"
        "print(vmemkv.__version__)\n")
    result = run_python(code, tmp_path, pythonpath=str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == vmemkv_version()


def vmemkv_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_top_level_package_exports_the_public_names_and_the_version():
    import vmemkv
    assert vmemkv.__version__ == vmemkv_version()
    for name in vmemkv._EXPORTS:
        assert getattr(vmemkv, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        vmemkv.nonsense


def test_every_package_folder_is_installed_under_vmemkv():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {folder: package for package, folder in setuptools["package-dir"].items()}
    on_disk = set()
    for top in ("vmemkv", *GENERIC):
        for init in (ROOT / top).rglob("__init__.py"):
            folder = init.parent.relative_to(ROOT).parts
            on_disk.add(".".join([mapped[folder[0]], *folder[1:]]))
    # a folder of data files only is a package of its own (setuptools ignores data in a
    # subfolder no package names): it has package data and no Python
    folder_of = setuptools["package-dir"]
    data_only = {package for package in setuptools["package-data"]
                 if not (ROOT / package_folder(package, folder_of) / "__init__.py").exists()}
    assert data_only == {"vmemkv.scheduler.data.traces"}
    assert on_disk | data_only == set(setuptools["packages"])


def package_folder(package: str, package_dir: dict) -> Path:
    """The repository folder of installed ``package`` (``package_dir``: pyproject's, a package
    to its folder)."""
    parts = package.split(".")
    size = max(n for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in package_dir)
    return Path(package_dir[".".join(parts[:size])], *parts[size:])


def python_sources():
    for top in ("vmemkv", *GENERIC, "tests"):
        yield from (ROOT / top).rglob("*.py")


def test_no_module_imports_a_generic_top_level_name():
    offenders = []
    for path in python_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n and n.split(".")[0] in GENERIC]
    assert not offenders, offenders


def test_no_layer_imports_the_command_line_or_the_benchmarks():
    """The command line sits on top: vmem, scheduler and runtime never import vmemkv.cli,
    vmemkv.bench or vmemkv.benchmarks."""
    upward = ("vmemkv.cli", "vmemkv.bench", "vmemkv.benchmarks")
    offenders = []
    for top in ("vmem", "scheduler", "runtime"):
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            offenders += [f"{path.relative_to(ROOT)}: {u}" for u in upward if u in text]
    assert not offenders, offenders


def architecture_modules() -> set:
    """Every module docs/ARCHITECTURE.md gives a job: the backticked paths in the first cell of
    each table row; a bare file name is in the folder of the path before it in that cell."""
    named = set()
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for token in line.split("|")[1].split("`")[1::2]:
            if "/" in token:
                folder = token.rsplit("/", 1)[0]
                named.add(token)
            else:
                named.add(f"{folder}/{token}")
    return named


def test_architecture_gives_every_module_a_job():
    modules = {str(p.relative_to(ROOT)) for top in ("vmemkv", *GENERIC)
               for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh")
               and p.name != "__init__.py" or p.relative_to(ROOT).as_posix() in (
                   "vmemkv/__init__.py", "scheduler/managers/__init__.py")}
    named = architecture_modules()
    assert modules - named == set(), "modules without a job in docs/ARCHITECTURE.md"
    assert named - modules == set(), "docs/ARCHITECTURE.md names modules that do not exist"
