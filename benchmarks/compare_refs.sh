#!/usr/bin/env bash
# Before/after in one run: the attention, engine and simulator benchmarks on two git refs of
# this repository, interleaved (old, new, old, new per benchmark) so machine load hits both.
#
#   bash benchmarks/compare_refs.sh OLD_REF NEW_REF [OUT_DIR]      # e.g. a30be9a main
#
# Each ref is checked out into OUT_DIR/<ref> with its own venv (the pinned CPU torch installs
# from local disk in seconds). Refs from before the vmemkv namespace run their benchmarks as
# `python -m benchmarks.X`, later ones as `python -m vmemkv.benchmarks.X`. Results: one JSON per
# benchmark and ref in OUT_DIR, and the printed tables in OUT_DIR/<bench>-<ref>.log.
set -euo pipefail
old=${1:?usage: compare_refs.sh OLD_REF NEW_REF [OUT_DIR]}
new=${2:?usage: compare_refs.sh OLD_REF NEW_REF [OUT_DIR]}
out=${3:-bench_out/compare}
repo=$(git rev-parse --show-toplevel)
mkdir -p "$out"
out=$(cd "$out" && pwd)

prepare() {   # ref -> checkout with a venv
    local dir="$out/src-$1"
    if [ ! -d "$dir" ]; then
        git -C "$repo" worktree add -q --detach "$dir" "$1"
        python3 -m venv "$dir/.venv"
        "$dir/.venv/bin/pip" install -q -c "$dir/constraints.txt" -e "$dir[hf,bench]" >/dev/null
    fi
}

module() {    # ref-dir bench -> module name
    if [ -f "$1/vmemkv/__init__.py" ]; then echo "vmemkv.benchmarks.$2"; else echo "benchmarks.$2"; fi
}

run() {       # ref bench args...
    local ref=$1 bench=$2; shift 2
    local dir="$out/src-$ref"
    echo "== $bench on $ref"
    (cd "$dir" && .venv/bin/python -m "$(module "$dir" "$bench")" "$@") 2>&1 | tee "$out/$bench-$ref.log"
}

prepare "$old"; prepare "$new"
for ref in "$old" "$new"; do run "$ref" attention --threads 2 --out "$out/attention-$ref.json"; done
for ref in "$old" "$new"; do run "$ref" engine --out "$out/engine-$ref.json"; done
for ref in "$old" "$new"; do run "$ref" simulate --json "$out/simulate-$ref.json"; done
echo "# wrote $out"
