"""Manager transactions: what begin()+commit(), a decode step's manager calls and a rollback
cost per step, by pool size, with and without a full prefix cache; and the append hot path
outside a transaction.

    .venv/bin/python -m vmemkv.benchmarks.txn [--pools 1000 10000 100000] [--json out.json]
    .venv/bin/python -m vmemkv.benchmarks.txn --before-python /path/to/old/.venv/bin/python

With ``--before-python`` this file also runs, as a script, under that interpreter (whose
``vmemkv`` is another checkout: the code before a change), alternating old and new twice, and
prints both side by side (the faster of the two runs of each). Only public manager calls are
used, so any checkout with ``begin``/``commit``/``rollback`` can be measured.

Managers: paged (16-token blocks) and vmem per-layer (pages of 16 tokens, so a unit holds the
same tokens as a block) for llama-3-8b. A pool of N units holds 32 running sequences of 193
tokens; "full cache" fills every other unit but 64 with cached prefix units (distinct prompts,
computed, freed). The decode step is begin, one append to each running sequence (every 16th
crosses into a new unit), commit. Times are medians in microseconds; a figure, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from vmemkv.benchmarks.common import (environment, exit_status, format_table, print_environment,
                                      write_json)
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.cliargs import POSITIVE_INT, DistinctValues, result_file
from vmemkv.scheduler.sim_memory import available_bytes

MODEL = get_model("llama-3-8b")
UNIT_TOKENS = 16
RUNNING, RUNNING_TOKENS, SLACK_UNITS, PROMPT_UNITS = 32, 193, 64, 256   # 193: 15 free in the last
MAX_SEQ_LEN = 8192
UNIT_HOST_BYTES = 8192    # a unit's manager records, charged (tracemalloc, full cache: vmem 4.7 KB, paged 0.7 KB)


def build(kind: str, units: int):
    unit_bytes = UNIT_TOKENS * MODEL.bytes_per_token
    if kind == "paged":
        return make_manager("paged", MODEL, units * unit_bytes, MAX_SEQ_LEN,
                            block_size_tokens=UNIT_TOKENS)
    page_bytes = unit_bytes // (2 * MODEL.num_layers)       # per-layer: 2L pages a group
    return make_manager("vmem", MODEL, units * unit_bytes, MAX_SEQ_LEN, page_bytes=page_bytes,
                        layout="per-layer", max_slots=256)


def populate(m, units: int, full_cache: bool) -> list:
    """Running sequences, and (full_cache) cached prompts in every other unit but the slack."""
    next_id, token = 10_000, 0
    if full_cache:
        left = units - RUNNING * -(-RUNNING_TOKENS // UNIT_TOKENS) - SLACK_UNITS
        while left > 0:
            n = min(PROMPT_UNITS, left) * UNIT_TOKENS
            m.allocate(next_id, n, list(range(token, token + n)))
            m.mark_computed(next_id, n)
            m.free(next_id)
            next_id, token, left = next_id + 1, token + n, left - n // UNIT_TOKENS
    for sid in range(RUNNING):
        m.allocate(sid, RUNNING_TOKENS)
    m.take_ops()
    return list(range(RUNNING))


def median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def measure(kind: str, units: int, full_cache: bool, repeats: int) -> dict:
    m = build(kind, units)
    seqs = populate(m, units, full_cache)

    def empty():
        m.begin()
        m.commit()

    def step(end):
        m.begin()
        for sid in seqs:
            m.append(sid)
        end()
        m.take_ops()

    row = {"manager": kind, "units": units, "cache": "full" if full_cache else "empty",
           "cached_units": len(m.cached_units()),
           "begin_commit_us": median_us(empty, repeats),
           "decode_step_us": median_us(lambda: step(m.commit), repeats),
           "rollback_step_us": median_us(lambda: step(m.rollback), repeats)}
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(UNIT_TOKENS - 1):     # stay inside the units (the hot path)
            for sid in seqs:
                m.append(sid)
        samples.append((time.perf_counter() - start) / ((UNIT_TOKENS - 1) * len(seqs)))
        for sid in seqs:                     # back to the same lengths: free and re-allocate
            m.free(sid)
            m.allocate(sid, RUNNING_TOKENS)
        m.take_ops()
    row["append_hot_ns"] = statistics.median(samples) * 1e9
    return row


def run_all(pools, repeats: int) -> list:
    rows = []
    for kind in ("paged", "vmem"):
        for units in pools:
            for full in (False, True):
                rows.append(measure(kind, units, full, repeats))
    return rows


COLUMNS = ["manager", "units", "cache", "cached_units", "begin_commit_us", "decode_step_us",
           "rollback_step_us", "append_hot_ns"]
TIMES = COLUMNS[4:]


def peak_tokens(repeats: int) -> int:
    """The tokens each running sequence holds at its longest: the timed decode steps that
    commit add ``repeats`` tokens (a rollback adds none), then the hot path appends
    ``UNIT_TOKENS - 1`` more before it frees them."""
    return RUNNING_TOKENS + repeats + UNIT_TOKENS - 1


def _pools_problem(units: int, repeats: int):
    """Why the running sequences cannot grow as the timing makes them (a pool too small for
    them, or sequences past ``MAX_SEQ_LEN``), naming the flags, or None. Either ended the run
    in ``OutOfCapacityError: sequence 31 needs 13 blocks`` / a RequestTooLargeError, which
    named neither --pools nor --repeats."""
    peak = peak_tokens(repeats)
    if peak > MAX_SEQ_LEN:
        return (f"--repeats {repeats}: each timed decode step that commits grows the "
                f"{RUNNING} running sequences by a token, to {peak} tokens, past the "
                f"{MAX_SEQ_LEN} one may hold: at most --repeats {MAX_SEQ_LEN - peak + repeats}")
    need_units = RUNNING * -(-peak // UNIT_TOKENS)
    if units < need_units:
        return (f"--pools {units}: the {RUNNING} running sequences grow to {peak} tokens "
                f"with --repeats {repeats}, {need_units} units of {UNIT_TOKENS} tokens: "
                f"give --pools of at least {need_units} (or fewer --repeats)")
    return None


def interpreter(text: str) -> str:
    """``--before-python``'s argparse type: an executable file (a path, or a command on PATH);
    a missing one ran the timing, then ended in a FileNotFoundError traceback."""
    found = shutil.which(text) if text else None
    if found is None or os.path.isdir(found):
        raise argparse.ArgumentTypeError(f"{text!r} is not an executable file or a command on "
                                         f"PATH: give the interpreter whose vmemkv is the code "
                                         f"before (e.g. /path/to/old/.venv/bin/python)")
    return text


def compare(before_python: str, pools, repeats: int) -> list:
    """Old and new, each run twice in turn as a subprocess; the faster run of each figure."""
    args = ["--pools", *map(str, pools), "--repeats", str(repeats), "--rows-only"]
    runs = {"before": [], "after": []}
    for _ in range(2):
        for label, python in (("before", before_python), ("after", sys.executable)):
            out = subprocess.run([python, __file__, *args], check=True, capture_output=True,
                                 text=True).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for i, base in enumerate(runs["after"][0]):
        row = {k: base[k] for k in COLUMNS[:4]}
        for label in ("before", "after"):
            for col in TIMES:
                row[f"{col}_{label}"] = min(r[i][col] for r in runs[label])
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = OneLineArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", type=POSITIVE_INT, nargs="+", default=[1000, 10_000, 100_000],
                    action=DistinctValues)
    ap.add_argument("--repeats", type=POSITIVE_INT, default=30)
    ap.add_argument("--before-python", type=interpreter,
                    help="interpreter whose vmemkv is the code before (checked when parsed)")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=result_file, help="write the rows here")
    args = ap.parse_args(argv)
    problem = _pools_problem(min(args.pools), args.repeats)
    if problem:
        ap.error(problem)
    need, available = max(args.pools) * UNIT_HOST_BYTES, available_bytes()
    if available is not None and need > available:
        ap.error(f"--pools {max(args.pools)}: a pool of that many units needs about "
                 f"{need / 2**30:.1f} GiB of host memory ({UNIT_HOST_BYTES} bytes a unit), more "
                 f"than the {available / 2**30:.1f} GiB available")
    if args.rows_only:
        print(json.dumps(run_all(args.pools, args.repeats)))
        return
    from vmemkv.benchmarks.suite import versions
    env = environment(seed=0, warmup=0, repeats=args.repeats, model=MODEL.name,
                      pools=",".join(map(str, args.pools)), **versions())
    print_environment(env)      # the machine the microseconds were timed on (none was said)
    if args.before_python:
        rows = compare(args.before_python, args.pools, args.repeats)
        columns = COLUMNS[:4] + [f"{c}_{x}" for c in TIMES for x in ("before", "after")]
    else:
        rows, columns = run_all(args.pools, args.repeats), COLUMNS
    print(format_table(rows, columns))
    write_json(args.json, {"environment": env, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(exit_status("txn", main))
