"""Every source file runs on the oldest Python that pyproject.toml's ``requires-python`` allows
(3.10): no syntax and no standard-library module or name that came later, unless it sits in the
body of an ``if sys.version_info >= (3, N):`` (whose ``else`` gives the older Python's way).
Before, ``scheduler/sweep_spec.py`` imported ``tomllib`` and called ``hashlib.file_digest``
(both 3.11), and every ``vmemkv`` command, even ``--help``, died on 3.10 with
``ModuleNotFoundError``. A static check: it needs no 3.10 interpreter."""
from __future__ import annotations

import ast
import hashlib
import io
import re

import pytest

from vmemkv.scheduler import sweep_spec

from .test_packaging import ROOT, python_sources

# module -> {name: the Python that added it}; a module alone (None) came whole in that version.
ADDED_IN = {
    "tomllib": {None: (3, 11)},
    "wsgiref.types": {None: (3, 11)},
    "hashlib": {"file_digest": (3, 11)},
    "typing": {**dict.fromkeys(("Self", "Required", "NotRequired", "LiteralString", "Never",
                                "assert_never", "assert_type", "reveal_type", "TypeVarTuple",
                                "Unpack", "dataclass_transform", "get_overloads",
                                "clear_overloads"), (3, 11)),
               "override": (3, 12), "TypeAliasType": (3, 12), "ReadOnly": (3, 13),
               "TypeIs": (3, 13)},
    "asyncio": dict.fromkeys(("TaskGroup", "timeout", "timeout_at", "Timeout", "Runner",
                              "Barrier"), (3, 11)),
    "enum": dict.fromkeys(("StrEnum", "ReprEnum", "verify", "EnumCheck", "FlagBoundary",
                           "global_enum", "member", "nonmember", "EnumType"), (3, 11)),
    "datetime": {"UTC": (3, 11)},
    "contextlib": {"chdir": (3, 11)},
    "operator": {"call": (3, 11)},
    "logging": {"getLevelNamesMapping": (3, 11), "getHandlerByName": (3, 12)},
    "math": {"cbrt": (3, 11), "exp2": (3, 11), "sumprod": (3, 12)},
    "inspect": {"getmembers_static": (3, 11), "markcoroutinefunction": (3, 12)},
    "sys": {"exception": (3, 11)},
    "re": {"NOFLAG": (3, 11)},
    "itertools": {"batched": (3, 12)},
    "copy": {"replace": (3, 13)},
}
BUILTINS_ADDED_IN = {"ExceptionGroup": (3, 11), "BaseExceptionGroup": (3, 11)}
METHODS_ADDED_IN = {"add_note": (3, 11), "__notes__": (3, 11), "file_digest": (3, 11),
                    "is_junction": (3, 12), "with_segments": (3, 12)}


def floor() -> tuple:
    """pyproject.toml's ``requires-python = ">=X.Y"`` as (X, Y)."""
    found = re.search(r'^requires-python = ">=(\d+)\.(\d+)"$',
                      (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml has no requires-python = \">=X.Y\""
    return int(found[1]), int(found[2])


def guarded_version(test: ast.expr):
    """The ``(3, N)`` of an ``if sys.version_info >= (3, N)`` test, else None."""
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.GtE)
            and ast.unparse(test.left) == "sys.version_info"):
        return ast.literal_eval(test.comparators[0])
    return None


class NewerThan(ast.NodeVisitor):
    """Collects ``line: what (version)`` for each use of something newer than ``oldest``."""

    def __init__(self, oldest: tuple):
        self.oldest, self.found, self.modules = oldest, [], {}

    def newer(self, node: ast.AST, what: str, added) -> None:
        if added is not None and added > self.oldest:
            self.found.append(f"{node.lineno}: {what} ({added[0]}.{added[1]})")

    def visit_If(self, node: ast.If) -> None:
        version = guarded_version(node.test)
        if version is None or version <= self.oldest:
            self.generic_visit(node)
            return
        self.visit(node.test)
        for child in node.orelse:      # the body runs only on a Python that has it
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.newer(node, f"import {alias.name}", ADDED_IN.get(alias.name, {}).get(None))
            self.modules[alias.asname or alias.name] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        added = ADDED_IN.get(node.module, {}) if node.level == 0 else {}
        self.newer(node, f"from {node.module} import", added.get(None))
        for alias in node.names:
            self.newer(node, f"from {node.module} import {alias.name}", added.get(alias.name))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        module = self.modules.get(node.value.id) if isinstance(node.value, ast.Name) else None
        self.newer(node, f"{module}.{node.attr}", ADDED_IN.get(module, {}).get(node.attr))
        if module is None:
            self.newer(node, f".{node.attr}", METHODS_ADDED_IN.get(node.attr))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self.newer(node, node.id, BUILTINS_ADDED_IN.get(node.id))


def newer_uses(source: str, oldest: tuple) -> list:
    """What ``source`` uses that Python ``oldest`` lacks: syntax (a one-item list naming the
    SyntaxError) or standard-library names, each as ``line: what (version)``."""
    try:
        tree = ast.parse(source, feature_version=oldest)
    except SyntaxError as error:
        return [f"{error.lineno}: syntax: {error.msg}"]
    visitor = NewerThan(oldest)
    visitor.visit(tree)
    return visitor.found


def test_no_source_file_uses_python_newer_than_requires_python():
    oldest = floor()
    offenders = [f"{path.relative_to(ROOT)}:{use}" for path in python_sources()
                 for use in newer_uses(path.read_text(), oldest)]
    assert not offenders, offenders


@pytest.mark.parametrize("source, expected", [
    ("import tomllib\n", ["1: import tomllib (3.11)"]),
    ("import hashlib\nhashlib.file_digest(f, 'sha256')\n", ["2: hashlib.file_digest (3.11)"]),
    ("import hashlib as h\nh.file_digest(f, 'sha256')\n", ["2: hashlib.file_digest (3.11)"]),
    ("from typing import Dict, Self\n", ["1: from typing import Self (3.11)"]),
    ("import enum\nclass A(enum.StrEnum): pass\n", ["2: enum.StrEnum (3.11)"]),
    ("try:\n    pass\nexcept ExceptionGroup as e:\n    e.add_note('x')\n",
     ["3: ExceptionGroup (3.11)", "4: .add_note (3.11)"]),
    ("try:\n    pass\nexcept* ValueError:\n    pass\n", None),     # syntax: named below
    ("import sys\nif sys.version_info >= (3, 11):\n    import tomllib\n"
     "else:\n    import tomli as tomllib\n", []),
    ("import sys\nif sys.version_info >= (3, 10):\n    import tomllib\n",
     ["3: import tomllib (3.11)"]),        # a guard the floor already passes guards nothing
    ("import typing_extensions\nfrom typing_extensions import Self\n", []),
])
def test_the_check_names_each_newer_use_and_honours_version_guards(source, expected):
    found = newer_uses(source, (3, 10))
    if expected is None:
        assert len(found) == 1 and ": syntax: " in found[0], found
    else:
        assert found == expected
        assert newer_uses(source, (3, 13)) == []      # each is there by 3.13


@pytest.mark.parametrize("size_bytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17])
def test_sha256_of_reads_the_rest_of_the_file_in_chunks(size_bytes):
    data = (bytes(range(256)) * (size_bytes // 256 + 1))[:size_bytes]
    expected = hashlib.sha256(data).hexdigest()
    assert sweep_spec.sha256_of(io.BytesIO(data), chunk_bytes=4096) == expected
    f = io.BytesIO(b"skip" + data)
    f.read(4)
    assert sweep_spec.sha256_of(f, chunk_bytes=4096) == expected
