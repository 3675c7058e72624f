"""benchmarks/fidelity_trace.py's per-request and per-step accounting on made-up steps (exact
numbers; no engine, no wall clock)."""
from __future__ import annotations

import pytest

from vmemkv.benchmarks.fidelity_trace import per_request, step_errors
from vmemkv.scheduler.profile_cost import ProfileCost


def step(start_s, end_s, seqs, pairs=0, context=0):
    return {"start_s": start_s, "end_s": end_s, "seconds": end_s - start_s, "seqs": seqs,
            "num_seqs": len(seqs), "new_tokens": sum(n for _, n, _ in seqs),
            "context_tokens": context, "prefill_pairs": pairs, "after_idle": False}


def test_each_request_is_split_into_its_wait_and_its_first_step():
    # seq 7 (request 0) arrives at 0.0 and prefills 0.001-0.009; seq 8 (request 1) arrives at
    # 0.004, waits for that step, prefills with seq 7's decode 0.009-0.015
    steps = [step(0.001, 0.009, [(7, 40, True)], 780),
             step(0.009, 0.015, [(7, 1, True), (8, 30, True)], 435)]
    reqs = per_request(steps, {7: 0, 8: 1}, [0.0, 0.004], [0.009, 0.015])
    assert [r["wait_s"] for r in reqs] == pytest.approx([0.001, 0.005])
    assert [r["to_token_s"] for r in reqs] == pytest.approx([0.008, 0.006])
    assert [r["ttft_s"] for r in reqs] == pytest.approx([0.009, 0.011])


def test_step_errors_split_prefill_mixed_cold_and_warm_decodes():
    cost = ProfileCost(base_s=0.001, per_seq_s=0.0, per_new_token_s=0.0, per_context_token_s=0.0,
                       per_cold_step_s=0.001)
    steps = [step(0.0, 0.002, [(1, 10, True)], 45)]                     # 1 ms charged: -50%
    steps += [step(0.0, 0.002, [(1, 1, True)]) for _ in range(3)]       # cold, 2 ms: exact
    steps += [step(0.0, 0.004, [(1, 1, True)])]                         # warm, 1 ms: -75%
    steps += [step(0.0, 0.001, [(1, 1, True), (2, 9, True)], 36)]       # mixed, 1 ms: exact
    out = step_errors(steps, cost)
    assert (out["prefill_steps"], out["cold_decode_steps"], out["warm_decode_steps"]) == (1, 3, 1)
    assert out["mixed_steps"] == 1 and out["mixed_median_rel_error"] == pytest.approx(0.0)
    assert out["prefill_median_rel_error"] == pytest.approx(-0.5)
    assert out["cold_decode_median_rel_error"] == pytest.approx(0.0)
    assert out["warm_decode_median_rel_error"] == pytest.approx(-0.75)
