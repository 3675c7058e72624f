"""Caches and attention backends are pure executors: no module under runtime/cache or
runtime/attention imports a memory manager or refers to one (it would tie correctness to when
the manager is read, and keep a plan from being executed in another process)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vmemkv.runtime.attention as attention
import vmemkv.runtime.cache as cache

EXECUTOR_DIRS = [Path(cache.__file__).parent, Path(attention.__file__).parent]
MODULES = sorted(p for d in EXECUTOR_DIRS for p in d.glob("*.py"))


def manager_references(source: str) -> list[str]:
    """Imports of the managers package and every identifier naming a manager, with lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names
                  if "manager" in n.lower() or "managers" in n.split(".")]
    return found


def test_executor_modules_exist():
    names = {p.name for p in MODULES}
    assert {"base.py", "vmem_cache.py", "paged_cache.py", "flash.py", "sdpa.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_executor_module_imports_or_names_a_manager(path):
    assert manager_references(path.read_text()) == []


def test_the_check_catches_a_manager_reference():
    assert manager_references("from vmemkv.scheduler.managers.base import MapExtent\n")
    assert manager_references("def f(cache):\n    return cache.manager.slot_of(0)\n")
    assert manager_references("def f(manager):\n    pass\n")
    assert not manager_references("from vmemkv.scheduler.plan import MapExtent\n")
