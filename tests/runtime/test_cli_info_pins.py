"""Pins of ``vmemkv info`` (runtime/info.py) and of the per-user cache folder (runtime/cache_dir.py)."""
from __future__ import annotations

import json
from pathlib import Path

from vmemkv.cli import main
from vmemkv.runtime.cache_dir import cache_root


def test_info_json_says_a_driver_with_a_reason_is_unavailable(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["drivers"], info
    for name, entry in info["drivers"].items():
        assert entry["available"] == (entry["reason"] is None), name
        assert ("granularity_bytes" in entry) == entry["available"], name
    default = info["drivers"][info["default_driver"]]
    assert default["available"]


def test_the_cache_folder_follows_the_variables_an_empty_one_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("VMEMKV_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "vmemkv"
    monkeypatch.setenv("VMEMKV_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("VMEMKV_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == Path(tmp_path / "home" / ".cache" / "vmemkv")
