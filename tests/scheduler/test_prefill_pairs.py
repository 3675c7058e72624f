"""The quadratic parts of prefill: ``cost.prefill_pairs`` (per sequence) and the step's new
tokens squared, the profile coefficients that charge them, in the cost model and in the
simulator's timing (exact numbers, no torch)."""
from __future__ import annotations

import json

import pytest

from vmemkv.scheduler.cost import prefill_pairs
from vmemkv.scheduler.plan import ScheduledSeq
from vmemkv.scheduler.profile_cost import PROFILE_FORMAT, ProfileCost, load_profile, profile_cost
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=4,
             weight_bytes=1_000_000)
LINEAR = dict(base_s=0.001, per_seq_s=1e-5, per_new_token_s=1e-4, per_context_token_s=1e-6)
PAIR_S = 1e-8
SQ_S = 2e-9
PREFILL_STEP_S = 3e-4


def seq(computed: int, new: int) -> ScheduledSeq:
    return ScheduledSeq(0, computed, new, None, True)


def write_profile(tmp_path, coefficients) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, "model": MODEL,
                                "coefficients": coefficients}))
    return str(path)


def test_a_decode_has_no_prefill_pairs():
    assert prefill_pairs([seq(0, 1), seq(99, 1), seq(4000, 1)]) == 0


def test_a_whole_prompt_adds_the_triangle_beyond_its_context():
    # 256 queries attend 1 + 2 + ... + 256 = 32,896 keys; 256 of those are the context read
    assert prefill_pairs([seq(0, 256)]) == 32_896 - 256 == 256 * 255 // 2


def test_a_chunk_after_a_cached_prefix_pays_for_the_prefix_too():
    # 100 new after 156 cached: 100 * 156 + 5,050 pairs, 256 context tokens
    assert prefill_pairs([seq(156, 100)]) == 100 * 156 + 5_050 - 256 == 99 * (312 + 100) // 2
    assert prefill_pairs([seq(156, 100), seq(0, 1), seq(0, 3)]) == 20_394 + 0 + 3


def test_profile_cost_charges_prefill_pairs():
    cost = ProfileCost(**LINEAR, per_prefill_pair_s=PAIR_S)
    linear = ProfileCost(**LINEAR)
    assert cost.step_seconds(256, 256, 0, 1, 32_640) == pytest.approx(
        linear.step_seconds(256, 256, 0, 1) + 32_640 * PAIR_S)


def test_profile_cost_charges_the_square_of_a_steps_new_tokens():
    cost = ProfileCost(**LINEAR, per_step_token_sq_s=SQ_S)
    assert cost.step_seconds(4096, 2048, 0, 8, 0) == pytest.approx(
        ProfileCost(**LINEAR).step_seconds(4096, 2048, 0, 8, 0) + 2048 ** 2 * SQ_S)


def test_profile_cost_charges_a_step_with_prefill_pairs_its_fixed_overhead():
    cost = ProfileCost(**LINEAR, per_prefill_step_s=PREFILL_STEP_S)
    linear = ProfileCost(**LINEAR)
    assert cost.step_seconds(16, 16, 0, 1, 120) == pytest.approx(
        linear.step_seconds(16, 16, 0, 1, 120) + PREFILL_STEP_S)
    assert cost.step_seconds(400, 4, 0, 4, 0) == linear.step_seconds(400, 4, 0, 4, 0)


def test_a_profile_without_the_prefill_coefficients_loads_with_them_zero(tmp_path):
    cost = profile_cost(load_profile(write_profile(tmp_path, LINEAR)))
    assert cost.per_prefill_pair_s == cost.per_step_token_sq_s == cost.per_prefill_step_s == 0
    assert cost.step_seconds(256, 256, 0, 1, 32_640) == cost.step_seconds(256, 256, 0, 1)


def test_simulated_ttft_of_a_prompt_is_its_prefill_step_with_the_quadratic_terms(tmp_path):
    path = write_profile(tmp_path, {**LINEAR, "per_prefill_pair_s": PAIR_S,
                                    "per_step_token_sq_s": SQ_S,
                                    "per_prefill_step_s": PREFILL_STEP_S})
    r = simulate([TraceEntry(100, 3, 0.0)],
                 SimConfig(policy="paged", profile=path, cache_bytes=8 * 10**6, max_seq_len=256))
    (timing,) = r.timings
    prefill = (0.001 + 1e-5 + 100 * 1e-4 + 100 * 1e-6 + 4_950 * PAIR_S + 100 ** 2 * SQ_S
               + PREFILL_STEP_S)
    decode = [0.001 + 1e-5 + 1e-4 + ctx * 1e-6 + SQ_S for ctx in (101, 102)]
    assert timing.ttft_s == pytest.approx(prefill, rel=1e-12)
    assert timing.token_times_s == pytest.approx(
        (prefill, prefill + decode[0], prefill + sum(decode)), rel=1e-12)
