#!/usr/bin/env bash
# The one script for a CUDA machine: GPU tests, then the quick benchmarks on the GPU.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (or OUT_DIR=... / $OUT, default gpu_out/)
#
# It installs nothing: it runs from the working tree (PYTHONPATH) with the machine's own python3,
# torch and cuda-bindings. Dry run on a CPU machine: DRY_RUN=1 bash benchmarks/gpu_check.sh
# runs every step with the CPU-only parts (GPU tests then skip cleanly).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT_DIR:-${OUT:-gpu_out}}}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

step() {  # step NAME COMMAND...: run, tee to OUT_DIR/NAME.log, remember failures
    local name=$1; shift
    echo "== $name: $*" | tee "$OUT_DIR/$name.log"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT_DIR/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

step env "$PYTHON" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
if [ -z "${DRY_RUN:-}" ]; then
    step gpu_tests "$PYTHON" -m pytest -q -m gpu tests -p no:cacheprovider
else
    step gpu_tests "$PYTHON" -m pytest -q -m gpu tests -p no:cacheprovider --co
fi
step info "$PYTHON" -m runtime.cli info --json
step alloc "$PYTHON" -m benchmarks.alloc --quick --out "$OUT_DIR/alloc.json"
echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED); logs in $OUT_DIR"
exit $status
