"""Plan size: the pickled bytes of a 256-sequence decode plan, per cache kind and page layout.

    .venv/bin/python -m vmemkv.benchmarks.plan_size [--seqs 256] [--json out.json]

The real Scheduler and managers (pure Python, no torch) with the table tracker a real cache
needs: 256 requests of random prompt lengths (seed 0) are admitted and prefilled, then
``--decodes`` decode steps are planned. A plan is plain data (pickle protocol 5); one line per
configuration: the median and largest decode plan, the admission plan (full placements), and
what the same decode step would weigh if it carried whole block tables instead of changes.
A figure, not a timed test.
"""
from __future__ import annotations

import pickle
import random
import statistics

from vmemkv.cli import OneLineArgumentParser, UsageError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig
from vmemkv.scheduler.tables import tracker_for
from vmemkv.scheduler.cliargs import NON_NEGATIVE_INT, POSITIVE_INT, result_file

from .common import exit_status, format_table, write_json

CONFIGS = [("vmem", "per-layer"), ("vmem", "interleaved"), ("paged", "per-layer")]
MAX_SEQ_LEN = 4096
MODEL, CACHE_BYTES = "llama-3-8b", 60 * 10**9


def plan_bytes(plan) -> int:
    return len(pickle.dumps(plan, protocol=5))


def build(kind: str, layout: str, seqs: int) -> Scheduler:
    manager = make_manager(kind, get_model(MODEL), CACHE_BYTES, MAX_SEQ_LEN, layout=layout,
                           block_size_tokens=16, max_slots=seqs)
    config = SchedulerConfig(max_running=seqs, max_tokens_per_step=1 << 20)
    return Scheduler(manager, config, tables=tracker_for(kind))


def measure(kind: str, layout: str, seqs: int, decodes: int, seed: int) -> dict:
    sched = build(kind, layout, seqs)
    rng = random.Random(seed)
    for rid in range(seqs):
        prompt = rng.randint(64, 1024)
        sched.add_request(Request(rid, prompt, decodes + 1, prompt_token_ids=[1] * prompt))
    admit = sched.schedule()                     # every prompt, whole: full placements
    _check_all_running(admit, seqs, kind, layout, "at admission")
    sched.update({s.seq_id: 1 for s in admit.seqs if s.sample})
    sizes, whole = [], []
    for step in range(decodes):
        plan = sched.schedule()
        _check_all_running(plan, seqs, kind, layout, f"at decode step {step + 1}")
        assert plan.num_new_tokens == seqs, "a pure decode step"
        sizes.append(plan_bytes(plan))
        whole.append(sizes[-1] + _whole_tables_bytes(kind, sched.manager, plan)
                     - len(pickle.dumps(plan.tables)))
        sched.update({s.seq_id: 1 for s in plan.seqs})
    return {"cache": kind if kind == "paged" else f"vmem {layout}", "seqs": seqs,
            "decode_median_bytes": int(statistics.median(sizes)), "decode_max_bytes": max(sizes),
            "bytes_per_seq": round(statistics.median(sizes) / seqs, 1),
            "admission_bytes": plan_bytes(admit),
            "whole_tables_decode_bytes": int(statistics.median(whole))}


def _check_all_running(plan, seqs: int, kind: str, layout: str, when: str) -> None:
    """Every sequence runs in ``plan``, else a UsageError naming --seqs: more sequences than
    the cache holds (about 450 with the default seed) were an AssertionError traceback."""
    if len(plan.seqs) == seqs:
        return
    raise UsageError(f"--seqs {seqs}: the {CACHE_BYTES / 1e9:.0f} GB cache of {MODEL} "
                     f"({kind} {layout}) runs only {len(plan.seqs)} of them at once "
                     f"{when}: give fewer --seqs (or --decodes)")


def _whole_tables_bytes(kind: str, mgr, plan) -> int:
    """Pickled size of the placements if every plan carried every sequence's whole table."""
    if kind == "paged":
        return len(pickle.dumps({s.seq_id: tuple(mgr.block_table(s.seq_id)) for s in plan.seqs}))
    return len(pickle.dumps({s.seq_id: mgr.slot_of(s.seq_id) for s in plan.seqs}))


def main(argv=None) -> dict:
    ap = OneLineArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=POSITIVE_INT, default=256)
    ap.add_argument("--decodes", type=POSITIVE_INT, default=32, help="decode steps measured")
    ap.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    ap.add_argument("--json", metavar="FILE", type=result_file, help="also write the JSON here")
    args = ap.parse_args(argv)
    rows = [measure(kind, layout, args.seqs, args.decodes, args.seed) for kind, layout in CONFIGS]
    print(f"pickled StepPlan of a {args.seqs}-sequence decode step (llama-3-8b, 2 MiB pages, "
          f"16-token blocks, seed {args.seed}, {args.decodes} decode steps)")
    print(format_table(rows, list(rows[0])))
    payload = {"seqs": args.seqs, "decodes": args.decodes, "seed": args.seed, "results": rows}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":   # main returns the payload (the tests read it), the status is 0
    raise SystemExit(exit_status("plan_size", lambda: main() and 0))
