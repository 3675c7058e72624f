"""``benchmarks/txn.py`` times microseconds, and its table and ``--json`` now say on what: the
environment line every timed benchmark prints first (device, torch, python, kernel, load),
also in the JSON (it wrote ``{"rows": ...}`` alone, with nothing to compare two runs by)."""
from __future__ import annotations

import json
import platform

from vmemkv.benchmarks import txn


def test_txn_prints_and_writes_the_environment_it_was_timed_in(tmp_path, capsys):
    out = tmp_path / "txn.json"
    txn.main(["--pools", "448", "--repeats", "1", "--json", str(out)])
    first = capsys.readouterr().out.splitlines()[0]
    env = json.loads(out.read_text())["environment"]
    assert first.startswith("# device=cpu") and f"python={platform.python_version()}" in first
    assert (env["python"], env["repeats"], env["model"], env["pools"]) == (
        platform.python_version(), 1, "llama-3-8b", "448")
    assert {"torch", "kernel", "load_1min"} <= set(env)
