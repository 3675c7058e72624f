#!/usr/bin/env bash
# The one script for a CUDA machine: the GPU tests, then the quick benchmark suite on the GPU.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (or OUT_DIR=... / $OUT; default gpu_out/)
#
# Steps (each logged to OUT_DIR/<step>.log, exit codes and times in OUT_DIR/summary.txt):
#   env        python, torch, CUDA runtime and driver, nvidia-smi
#   info       vmemkv info --json (drivers with granularity, attention backends)
#   gpu_tests  pytest -m gpu: CUDA driver semantics (tests/vmem), attention correctness of
#              every backend on both layouts, random mixes through real CUDA caches against a
#              shadow copy (tests/runtime), the engine on CUDA against transformers
#              (tests/engine); JUnit XML in OUT_DIR
#   bench      vmemkv bench --quick --device cuda: JSON, log and PNGs in OUT_DIR/bench/
#   attention  benchmarks/attention.py --device cuda: issue 4's grid (batch 1/8/32, context
#              512/2k/8k, decode and prefill, vmem and paged, fp16); OUT_DIR/attention.json
# Budget: under 6 minutes on an H200 (each step has a timeout; see *_TIMEOUT below).
# To rerun only part after a failure (GPU time is scarce): GPU_TESTS=tests/vmem (pytest paths,
# default tests), BENCH_ONLY="alloc attention" (sections for --only, default all),
# SKIP_ATTENTION=1 (leave out the full attention grid).
#
# It installs nothing: it runs from the working tree (PYTHONPATH on a folder of symlinks that
# lays the tree out as installed: vmemkv/{vmem,scheduler,runtime,benchmarks}) with the checkout's
# ./.venv/bin/python when there is one, else the machine's python3 (PYTHON=... overrides), and
# that Python's torch, cuda-bindings and pytest. EXTRA_PYTHONPATH is appended after the tree (for
# carried pure-Python test deps). Dry run on a CPU machine:
#   DRY_RUN=1 bash benchmarks/gpu_check.sh /tmp/x
# runs every step on the CPU, at toy sizes (it checks the plumbing, not performance): the GPU
# tests are collected and must all skip cleanly, the suite runs as `bench --smoke --device cpu`,
# the attention grid at toy head sizes. Nothing calls CUDA.
#
# Through the device tool (which returns at most 8 files from $OUT), write elsewhere and pack:
#   bash benchmarks/gpu_check.sh /tmp/gc; rc=$?; tar czf "$OUT/gpu_check.tgz" -C /tmp gc; exit $rc
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT_DIR:-${OUT:-gpu_out}}}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TEST_TIMEOUT="${TEST_TIMEOUT:-240}"     # seconds
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"   # seconds
ATTENTION_TIMEOUT="${ATTENTION_TIMEOUT:-120}"
BENCH_ARGS=(--quick --device cuda)
ATTENTION_ARGS=(--device cuda)
if [ -n "${DRY_RUN:-}" ]; then   # toy sizes: every step and output file, in seconds
    BENCH_ARGS=(--smoke --device cpu)
    ATTENTION_ARGS=(--device cpu --quick --batches 1 2 --contexts 32 64 --heads 4 --kv-heads 2
                    --head-dim 16 --prefill-len 8 --repeats 1)
fi
mkdir -p "$OUT_DIR"
# The layers import as vmemkv.vmem, vmemkv.scheduler, ... (setuptools package-dir). Without an
# install, mirror that layout with symlinks so every import resolves to this working tree.
NS_ROOT=$(mktemp -d)
trap 'rm -rf "$NS_ROOT"' EXIT
mkdir "$NS_ROOT/vmemkv"
for f in vmemkv/*.py; do ln -s "$PWD/$f" "$NS_ROOT/vmemkv/"; done
for d in vmem scheduler runtime benchmarks; do ln -s "$PWD/$d" "$NS_ROOT/vmemkv/$d"; done
export PYTHONPATH="$NS_ROOT:$PWD${PYTHONPATH:+:$PYTHONPATH}${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
START=$SECONDS
: > "$OUT_DIR/summary.txt"

step() {  # step NAME TIMEOUT COMMAND...: run, tee to OUT_DIR/NAME.log, remember failures
    local name=$1 limit=$2; shift 2
    echo "== $name: $*" | tee "$OUT_DIR/$name.log"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "== $name: timed out after $limit s" | tee -a "$OUT_DIR/$name.log"
    echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT_DIR/$name.log"
    printf '%-22s exit %3d  %4d s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT_DIR/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

step env 60 "$PYTHON" - <<'EOF'
import platform, subprocess, sys
import torch
print("python", sys.version.split()[0], platform.machine(), "kernel", platform.release())
print("torch", torch.__version__, "cuda runtime", torch.version.cuda,
      "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())
try:
    from cuda.bindings import driver as cu
    err, v = cu.cuDriverGetVersion()
    print("cuda driver", f"{v // 1000}.{v % 1000 // 10}" if int(err) == 0 else err)
except Exception as e:
    print("cuda-bindings:", type(e).__name__, e)
for mod in ("pytest", "hypothesis", "matplotlib", "tqdm", "flash_attn", "transformers"):
    try:
        m = __import__(mod); print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "not importable:", type(e).__name__)
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,mig.mode.current",
                          "--format=csv"], capture_output=True, text=True, timeout=20).stdout)
except Exception as e:
    print("nvidia-smi:", type(e).__name__)
EOF
step info 60 "$PYTHON" -m vmemkv.cli info --json
# shellcheck disable=SC2086  # GPU_TESTS and BENCH_ONLY are word lists
step gpu_tests "$TEST_TIMEOUT" "$PYTHON" -m pytest -q -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider \
    --junitxml "$OUT_DIR/gpu_tests.xml" -rs
if [ -n "${DRY_RUN:-}" ]; then   # on the CPU every GPU test must skip, none may run or fail
    step gpu_tests_all_skipped 30 "$PYTHON" - "$OUT_DIR/gpu_tests.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
n, skipped = int(suite.get("tests")), int(suite.get("skipped"))
print(f"{n} GPU tests collected, {skipped} skipped")
sys.exit(0 if n and n == skipped else 1)
EOF
fi
step bench "$BENCH_TIMEOUT" "$PYTHON" -m vmemkv.cli bench "${BENCH_ARGS[@]}" \
    --out "$OUT_DIR/bench" --no-progress ${BENCH_ONLY:+--only $BENCH_ONLY}
[ -z "${SKIP_ATTENTION:-}" ] && step attention "$ATTENTION_TIMEOUT" "$PYTHON" -m vmemkv.benchmarks.attention \
    "${ATTENTION_ARGS[@]}" --out "$OUT_DIR/attention.json"
# Digest for whoever reads the run: test counts, the attention ratios, which flash path ran.
"$PYTHON" - "$OUT_DIR" >> "$OUT_DIR/summary.txt" 2>&1 <<'EOF'
import json, pathlib, re, sys, xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
try:
    root = ET.parse(out / "gpu_tests.xml").getroot()
    s = root if root.tag == "testsuite" else root.find("testsuite")
    n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
    print(f"gpu tests: {n - f - e - k} passed, {f} failed, {e} errors, {k} skipped")
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print("  FAILED", case.get("classname"), case.get("name"))
except (OSError, ET.ParseError) as error:
    print("gpu tests: no JUnit XML:", error)
try:
    att = json.loads((out / "attention.json").read_text())
    print("attention backends:", att["environment"].get("backends"), " dtype:", att["environment"].get("dtype"))
    for r in att["speedups"]:
        print(f"  {r['phase']:7s} b{r['batch']:<3d} ctx{r['ctx']:<5d} paged/vmem {r['paged_over_vmem']:.2f}x")
except (OSError, KeyError, ValueError) as error:
    print("attention: no results:", error)
said = set()
for log in sorted(out.glob("*.log")) + sorted(out.glob("bench/*.log")):
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"flash: .{0,160}", line)
        if m and m.group(0) not in said:
            said.add(m.group(0))
            print("  said:", m.group(0))
EOF
echo "total $((SECONDS - START)) s (budget 360 s on an H200)" | tee -a "$OUT_DIR/summary.txt"
echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED)${DRY_RUN:+ (dry run on the CPU)}; python $PYTHON; logs in $OUT_DIR"
cat "$OUT_DIR/summary.txt"
exit $status
