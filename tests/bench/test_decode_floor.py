"""benchmarks/decode_floor.c (built by hand, not imported; issue 30): its timed loops compute
what the kernel computes, so the floor it reports is the floor of the kernel's arithmetic. It
checks itself before timing; here it is built at both vector widths and run for one pass."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from vmemkv.runtime.attention import native

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "benchmarks" / "decode_floor.c"
ATTENTION = REPO / "runtime" / "attention"


def build(tmp_path: Path, source: Path = SOURCE, *flags: str) -> Path:
    cc = native.compiler_command()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc, or $CC)")
    out = tmp_path / source.stem
    subprocess.run([*cc, "-O2", "-march=native", "-ffp-contract=fast", *flags, f"-I{ATTENTION}",
                    str(source), "-o", str(out), "-lm"], check=True, capture_output=True, text=True)
    return out


@pytest.mark.parametrize("lanes", [None, 8], ids=["native width", "8 lanes"])
def test_every_dtype_row_is_checked_then_timed(tmp_path, lanes):
    binary = build(tmp_path, SOURCE, *([f"-DVW={lanes}"] if lanes else []))
    run = subprocess.run([str(binary), "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = re.findall(r"^(f32|bf16|e4m3|i8) +([\d.]+) ns +([\d.]+) ns +([\d.]+) ns +(\d+)%$",
                      run.stdout, re.M)
    assert [r[0] for r in rows] == ["f32", "bf16", "e4m3", "i8"]
    for _, scores, values, total, _ in rows:
        assert float(scores) > 0 and float(values) > 0
        assert float(total) == pytest.approx(float(scores) + float(values), abs=0.11)
    width = int(re.search(r"(\d+)-lane vectors", run.stdout).group(1))
    assert width == (lanes or width) and f"{2 * 32 * 128 // width} vector FMAs" in run.stdout
    pipes = re.search(r"^pipes: 16 FMAs a round ([\d.]+) ns; with 8 vpermi2b beside them "
                      r"([\d.]+)x, with 8 vpunpcklbw ([\d.]+)x$", run.stdout, re.M)
    if width == 16 and vbmi():   # the fp8 table's CPUs: the pipes it shares are measured
        assert pipes and all(float(x) > 0 for x in pipes.groups())
    else:
        assert pipes is None and "pipes:" not in run.stdout


def vbmi() -> bool:
    """Whether this CPU has AVX-512 VBMI (the kernel's fp8 table; Linux's /proc/cpuinfo)."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512vbmi" in cpuinfo.read_text().split()


def test_queries_left_in_memory_order_are_refused_where_fp8_is_read_in_blocks(tmp_path):
    """With the table (AVX-512 VBMI) e4m3 comes in FP8_BLOCKS order: a harness that did not put
    its queries in that order scores other sums, and the check names it (exit 1)."""
    if not vbmi():
        pytest.skip("fp8 is read in blocks only with AVX-512 VBMI")
    wrong = tmp_path / "unordered_floor.c"
    text = SOURCE.read_text()
    line = "        to_loader_order(dtypes[d], qd, HEADS * ROWS);\n"
    assert line in text
    wrong.write_text(text.replace(line, ""))
    run = subprocess.run([str(build(tmp_path, wrong)), "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert re.search(r"e4m3 scores: key 30 row 0: lanes sum to .*, q \. K is ", run.stderr)


def test_a_loop_that_computes_something_else_is_refused(tmp_path):
    """The second key's partials scored against the first key's K rows: exit 1, named."""
    wrong = tmp_path / "wrong_floor.c"
    text = SOURCE.read_text()
    assert "sum[1] += qx * kr[1][x];" in text
    wrong.write_text(text.replace("sum[1] += qx * kr[1][x];", "sum[1] += qx * kr[0][x];"))
    run = subprocess.run([str(build(tmp_path, wrong)), "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert re.search(r"f32 scores: key 31 row \d+ lane \d+: .*, want ", run.stderr)


def test_reps_must_be_given(tmp_path):
    run = subprocess.run([str(build(tmp_path)), "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "usage" in run.stderr
