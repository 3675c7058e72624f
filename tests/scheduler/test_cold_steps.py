"""Cold steps: the first ``COLD_STEPS`` decode-only steps after a prefill, which a profile
charges ``per_cold_step_s`` more, and the first step after idle time, ``per_idle_wake_s`` more
(exact numbers, no torch)."""
from __future__ import annotations

import json

import pytest

from vmemkv.scheduler.cost import COLD_STEPS, AfterPrefill
from vmemkv.scheduler.profile_cost import PROFILE_FORMAT, ProfileCost
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=4,
             weight_bytes=1_000_000)
LINEAR = dict(base_s=0.001, per_seq_s=1e-5, per_new_token_s=1e-4, per_context_token_s=1e-6)
COLD_S = 5e-4
WAKE_S = 7e-4


def test_the_three_decode_steps_after_a_prefill_are_cold():
    after = AfterPrefill()
    # (prefill pairs, sequences) per step: prefill, 4 decodes, an idle step, a mixed step
    # (prefill + decodes), 2 decodes
    steps = [(120, 1), (0, 1), (0, 2), (0, 2), (0, 2), (0, 0), (4950, 3), (0, 3), (0, 3)]
    assert [after.cold(p, n) for p, n in steps] == [
        False, True, True, True, False, False, False, True, True]
    assert COLD_STEPS == 3


def test_a_step_with_no_sequences_uses_up_no_cold_step():
    """Idle steps between a prefill and its decodes are not decode steps: the three decodes
    after them are still the cold ones."""
    after = AfterPrefill()
    steps = [(120, 1), (0, 0), (0, 0), (0, 1), (0, 1), (0, 1), (0, 1)]
    assert [after.cold(p, n) for p, n in steps] == [
        False, False, False, True, True, True, False]


def test_decodes_before_any_prefill_are_warm():
    after = AfterPrefill()
    assert [after.cold(0, 1) for _ in range(4)] == [False] * 4


def test_profile_cost_charges_a_cold_step():
    cost = ProfileCost(**LINEAR, per_cold_step_s=COLD_S)
    assert cost.step_seconds(100, 1, 0, 1, 0, cold_step=True) == pytest.approx(
        cost.step_seconds(100, 1, 0, 1, 0) + COLD_S)


def test_simulated_token_times_charge_the_three_decodes_after_the_prefill(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "model": MODEL,
                                "coefficients": {**LINEAR, "per_cold_step_s": COLD_S}}))
    r = simulate([TraceEntry(10, 6, 0.0)],
                 SimConfig(policy="paged", profile=str(path), cache_bytes=8 * 10**6,
                           max_seq_len=64))
    prefill = 0.001 + 1e-5 + 10 * 1e-4 + 10 * 1e-6
    decodes = [0.001 + 1e-5 + 1e-4 + ctx * 1e-6 + (COLD_S if k < 3 else 0.0)
               for k, ctx in enumerate(range(11, 16))]
    (timing,) = r.timings
    expected, t = [prefill], prefill
    for d in decodes:
        t += d
        expected.append(t)
    assert timing.token_times_s == pytest.approx(expected, rel=1e-12)


def test_the_first_step_after_idle_time_costs_the_wake_up(tmp_path):
    """Requests at 0 s and 1 s: each one's prefill follows idle time; a request arriving
    while one runs is stepped without it."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "model": MODEL,
                                "coefficients": {**LINEAR, "per_idle_wake_s": WAKE_S}}))
    r = simulate([TraceEntry(10, 1, 0.0), TraceEntry(10, 1, 1.0), TraceEntry(10, 1, 1.001)],
                 SimConfig(policy="paged", profile=str(path), cache_bytes=8 * 10**6,
                           max_seq_len=64))
    prefill = 0.001 + 1e-5 + 10 * 1e-4 + 10 * 1e-6
    assert [t.ttft_s for t in r.timings] == pytest.approx(
        [prefill + WAKE_S, prefill + WAKE_S, (prefill + WAKE_S - 0.001) + prefill], rel=1e-9)
