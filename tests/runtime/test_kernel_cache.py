"""The native builds' cache folder does not grow without bound: a build is touched whenever it
is loaded, and each new build deletes the builds of its source not loaded for 30 days (older
sources' keys, which nothing names any more)."""
from __future__ import annotations

import os
import time

import pytest

from vmemkv.runtime.attention import native

DAY_S = 24 * 3600


def age(path, days: float) -> None:
    then = time.time() - days * DAY_S
    os.utime(path, (then, then))


def test_prune_removes_only_this_sources_builds_unused_for_30_days(tmp_path):
    old, recent, kept = (tmp_path / f"kern-{n}.so" for n in ("a" * 16, "b" * 16, "c" * 16))
    other = tmp_path / "yardstick-dddddddddddddddd.so"
    for path, days in ((old, 31), (recent, 29), (kept, 400), (other, 400)):
        path.write_bytes(b"")
        age(path, days)
    assert native.prune_builds(tmp_path, "kern", keep=kept) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (recent, kept, other))


@pytest.mark.skipif(native.compiler_command() is None, reason="no C compiler")
def test_loading_a_build_keeps_it_and_a_new_source_prunes_the_stale_one(tmp_path, monkeypatch):
    monkeypatch.setenv("VMEMKV_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "tiny.c"
    source.write_text("int one(void) { return 1; }\n")
    first = native._build(native.compiler_command(), source, ())
    age(first, 40)
    assert native._build(native.compiler_command(), source, ()) == first      # a hit: touched
    assert time.time() - first.stat().st_mtime < DAY_S
    age(first, 40)                                                      # then unused 40 days
    source.write_text("int one(void) { return 2; }\n")                  # a new version
    second = native._build(native.compiler_command(), source, ())
    assert second != first and second.exists() and not first.exists()
