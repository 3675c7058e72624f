"""benchmarks/decode_profile.c (built by hand, not imported; issues 30 and 33): the kernel's
decode timed from C on the vmem layout or, with BLOCK, the paged one (the requests' blocks
interleaved). Both hold the same K/V, so a call's outputs are equal; ``huge`` asks for 2 MiB
pages and says how many it got."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from vmemkv.runtime.attention import native

LINE = re.compile(r"^(\w+)( paged)? threads=1 b3 ctx100 copies=2: min [\d.]+ ns/row \([\d.]+ GB/s\), "
                  r"median [\d.]+ ns/row \([\d.]+ GB/s\); out_sum=(\S+)$", re.M)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """dtype -> decode_profile built for it alone at D = 128 (as decode_kernel.py builds it)."""
    from vmemkv.benchmarks.decode_kernel import build as build_for
    if native.compiler_command() is None:
        pytest.skip("no C compiler (cc/gcc, or $CC)")
    built: dict = {}
    directory = tmp_path_factory.mktemp("decode_profile")

    def get(dtype: str) -> Path:
        if dtype not in built:
            built[dtype] = build_for(directory, dtype)
        return built[dtype]
    return get


def run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "e4m3"])
def test_the_paged_layout_reads_the_same_kv_as_vmem(build, dtype):
    sums = {}
    for block in (None, "16", "7"):           # 7: the last block of each request part full
        done = run(build(dtype), dtype, "1", "3", "100", "2", "3", *([block] if block else []))
        assert done.returncode == 0, done.stderr
        (match,) = LINE.findall(done.stdout)
        assert match[0] == dtype and match[1] == (" paged" if block else "")
        sums[block] = match[2]
    assert sums["16"] == sums["7"] == sums[None] and float(sums[None]) != 0.0


def test_huge_says_how_many_huge_pages_it_got(build):
    done = run(build("e4m3"), "e4m3", "1", "3", "100", "2", "3", "16", "huge")
    assert done.returncode == 0, done.stderr
    assert LINE.search(done.stdout)
    got = re.search(r"^huge pages: (-?\d+) MiB under 1 MiB of K/V$", done.stdout, re.M)
    assert got and int(got.group(1)) >= -1     # -1: no smaps_rollup; else what the kernel gave


@pytest.mark.parametrize("args", [["e4m3", "1", "3", "100", "2"],
                                  ["e4m3", "1", "3", "100", "2", "3", "16", "big"],
                                  ["e4m3", "1", "3", "100", "2", "3", "-1"]])
def test_bad_arguments_exit_2_with_the_usage_or_the_rule(build, args):
    done = run(build("e4m3"), *args)
    assert done.returncode == 2
    assert "usage" in done.stderr or "BLOCK >= 0" in done.stderr
