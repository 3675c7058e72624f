"""The simulator's hybrid preset (Gemma 3 27B: five 1,024-token local layers to one global) at
long contexts: window-aware allocation on vmem per-layer runs a larger batch and more output
tokens per second than full allocation (per-layer without parts, interleaved, paged)."""
import pytest

from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

LONG = generate(WorkloadSpec(num_requests=20, prompt_median=16000, prompt_p95=30000,
                             output_mean=4000, output_p95=12000, max_total_len=32768, seed=0))
SCHED = SchedulerConfig(watermark=0.05, max_tokens_per_step=8192)


def run(**kw):
    return simulate(LONG, SimConfig(model="gemma-3-27b", device="h200", cache_bytes=40 * 10**9,
                                    max_seq_len=32768, scheduler=SCHED, **kw))


@pytest.fixture(scope="module")
def runs():
    return {"window-aware": run(policy="vmem"),
            "per-layer full": run(policy="vmem", hybrid_parts=False),
            "interleaved": run(policy="vmem", layout="interleaved"),
            "paged": run(policy="paged")}


def test_window_aware_allocation_doubles_the_batch_at_long_contexts(runs):
    """vmem per-layer (parts) and paged (one block table per block group) give back the
    windowed layers' memory; per-layer without parts and interleaved keep it."""
    fulls = [runs["per-layer full"], runs["interleaved"]]
    for aware in (runs["window-aware"], runs["paged"]):
        assert all(r.output_tokens == aware.output_tokens for r in fulls)
        for full in fulls:
            assert aware.mean_batch > 1.9 * full.mean_batch
            assert aware.output_tokens_per_s > 1.4 * full.output_tokens_per_s
            assert aware.num_preemptions <= full.num_preemptions


def test_the_small_run_gives_the_documented_figures(runs):
    """Deterministic: the same workload and config give these numbers on any machine."""
    aware, full = runs["window-aware"], runs["per-layer full"]
    assert (round(aware.mean_batch, 1), round(full.mean_batch, 1)) == (5.8, 2.9)
    assert aware.kv_cache_usage_perc < full.kv_cache_usage_perc


# 4 windowed layers (window 8) beside 2 full ones
HYBRID_SPEC = ModelSpec("h", 6, 1, 1, 1, weight_bytes=0, layer_windows=(8, 8, None, 8, 8, None))


def drive_hybrid_workload(m, preemption: str, share: bool):
    """30 requests (every other one a prefix of one shared prompt, every third with n=2) through
    a Scheduler over ``m`` until all end, integrity checked after every step; the scheduler."""
    import random

    from vmemkv.scheduler.request import Request
    from vmemkv.scheduler.scheduler import Scheduler

    s = Scheduler(m, SchedulerConfig(watermark=0.0, max_tokens_per_step=16, max_running=16,
                                     preemption=preemption, check_every_step=True,
                                     enable_prefix_sharing=share))
    rng = random.Random(1)
    base = [rng.randrange(50) for _ in range(40)]
    for i in range(30):
        p = rng.randrange(2, 40)
        ids = base[:p] if i % 2 else [rng.randrange(50) for _ in range(p)]
        s.add_request(Request(i, p, rng.randrange(1, 50), prompt_token_ids=ids, n=1 + (i % 3 == 0)))
    while s.has_unfinished():
        plan = s.schedule()
        s.update({x.seq_id: 7 for x in plan.seqs if x.sample})
    return s


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("share", [False, True])
def test_the_scheduler_finishes_everything_over_a_hybrid_manager(preemption, share):
    """Preemption (a sequence behind its window is recomputed even under swap), forks, prefix
    sharing, integrity checked after every step; every request ends and memory comes back."""
    from vmemkv.scheduler.managers import make_manager

    m = make_manager("vmem", HYBRID_SPEC, 12 * 2 * 60, 96, page_bytes=2, swap_bytes=10**6,
                     hybrid_parts=True)
    s = drive_hybrid_workload(m, preemption, share)
    assert s.metrics.num_finished_requests == 30 and s.metrics.num_preemptions > 0
    assert m.stats().live_tokens == 0 and m.bound_pages <= m.pool_pages


def test_paged_end_waste_is_in_whole_tokens_below_a_block_per_sequence(runs):
    """A paged hybrid's stats count block-group tokens (one per group); the end waste was read
    as whole tokens, 62 groups' worth per sequence (232.5 tokens per sequence of 16-token
    blocks). In whole tokens a sequence wastes under a block."""
    assert 0 < runs["paged"].mean_end_waste_tokens < 16
