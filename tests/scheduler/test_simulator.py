"""Simulator results are plausible on the standard workload (docs/simulation.md), or its head."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.scheduler import SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry, WorkloadSpec, generate

STANDARD = generate(WorkloadSpec())        # 2,000 requests at time 0, seed 0
# Its first 600 requests on half the memory: at 10 GB the mean batch is 17 (reserve-max), 37
# (reserve-oracle), 43 (paged), so 14 or more batches' worth queue at time 0, memory limits
# every policy's batch, and it grows at 20 and 30 GB (no preemptions). The whole workload at 20,
# 40 and 60 GB gave the same orders and took 10 s of CPU; this takes 3.
HEAD = STANDARD[:600]
GB = 10**9
# 100 requests: at 2 GB without a watermark, 44 preemptions (recompute or swap); 3,678 page
# maps under vmem interleaved (at 200: 82 and 7,557, in twice the time)
SMALL = generate(WorkloadSpec(num_requests=100, seed=3))
WM5 = SchedulerConfig(watermark=0.05)


def run(entries, **kw):
    kw.setdefault("scheduler", WM5)
    return simulate(entries, SimConfig(**kw))


@pytest.fixture(scope="module")
def at_10gb():
    out = {p: run(HEAD, policy=p, cache_bytes=10 * GB)
           for p in ("reserve-max", "reserve-oracle", "paged")}
    out["vmem-interleaved"] = run(HEAD, policy="vmem", layout="interleaved", cache_bytes=10 * GB)
    return out


def test_every_output_token_is_generated(at_10gb):
    want = sum(e.output_len for e in HEAD)
    assert all(r.output_tokens == want and r.num_requests == 600 for r in at_10gb.values())


def test_utilisation_orders_reserve_max_below_oracle_below_paged(at_10gb):
    u = {k: r.kv_utilization for k, r in at_10gb.items()}
    assert u["reserve-max"] < u["reserve-oracle"] < u["paged"]
    assert u["paged"] > 0.95          # 16-token blocks waste 7.5 tokens per sequence


def test_finer_allocation_gives_bigger_batches_and_more_throughput(at_10gb):
    r = at_10gb
    assert r["reserve-max"].mean_batch < r["reserve-oracle"].mean_batch < r["paged"].mean_batch
    assert r["reserve-max"].output_tokens_per_s < r["paged"].output_tokens_per_s
    assert r["vmem-interleaved"].output_tokens_per_s > r["reserve-oracle"].output_tokens_per_s


def test_paged_end_waste_is_about_half_a_block(at_10gb):
    assert at_10gb["paged"].mean_end_waste_tokens == pytest.approx(7.5, abs=1.0)


@pytest.mark.parametrize("policy", ["paged", "reserve-oracle"])
def test_more_memory_never_lowers_throughput(policy, at_10gb):
    tps = [at_10gb[policy].output_tokens_per_s] + [
        run(HEAD, policy=policy, cache_bytes=gb * GB).output_tokens_per_s for gb in (20, 30)]
    assert tps == sorted(tps)


def test_simulation_is_deterministic():
    a, b = run(SMALL, cache_bytes=2 * 10**9).to_dict(), run(SMALL, cache_bytes=2 * 10**9).to_dict()
    a.pop("wall_seconds"), b.pop("wall_seconds")
    assert a == b


def test_zero_watermark_on_a_small_cache_preempts_and_recomputes():
    r = run(SMALL, cache_bytes=2 * 10**9, scheduler=SchedulerConfig(watermark=0.0))
    assert r.num_preemptions > 0 and r.recomputed_tokens > 0
    assert r.output_tokens == sum(e.output_len for e in SMALL)


def test_swap_preemption_recomputes_nothing_when_swap_space_suffices():
    r = run(SMALL, cache_bytes=2 * 10**9, swap_bytes=10 * 10**9,
            scheduler=SchedulerConfig(watermark=0.0, preemption="swap"))
    assert r.num_preemptions == r.num_swap_preemptions > 0 and r.recomputed_tokens == 0


def test_poisson_arrivals_idle_until_the_next_request():
    entries = generate(WorkloadSpec(num_requests=50, arrival_rate=0.5, seed=1))
    r = run(entries)
    assert r.simulated_seconds > entries[-1].arrival_s
    assert r.serving["median_ttft_ms"] > 0 and r.num_preemptions == 0


def test_requests_join_at_their_arrival_whatever_their_order_in_the_list():
    """A list not in arrival order runs as the sorted one: each request is queued at its own
    arrival and its latencies count from it, not from the later arrival listed before it."""
    entries = [TraceEntry(300, 20, 2.0), TraceEntry(100, 10, 0.0), TraceEntry(200, 5, 1.0)]
    shuffled, ordered = (run(e, cache_bytes=GB).to_dict() for e in
                         (entries, sorted(entries, key=lambda e: e.arrival_s)))
    shuffled.pop("wall_seconds"), ordered.pop("wall_seconds")
    assert shuffled == ordered
    assert ordered["simulated_seconds"] > 2.0


def test_map_latency_makes_vmem_slower_and_counts_map_ops():
    fast = run(SMALL, policy="vmem", layout="interleaved")
    slow = run(SMALL, policy="vmem", layout="interleaved", map_latency_s=20e-6)
    assert slow.mapped_page_ops == fast.mapped_page_ops > 0
    assert slow.simulated_seconds > fast.simulated_seconds


def test_paged_slowdown_applies_only_to_paged():
    assert run(SMALL, paged_slowdown=1.3).simulated_seconds > run(SMALL).simulated_seconds
    assert (run(SMALL, policy="reserve-oracle", paged_slowdown=1.3).simulated_seconds
            == run(SMALL, policy="reserve-oracle").simulated_seconds)


def test_result_has_the_documented_keys():
    d = run(SMALL).to_dict()
    for key in ("mean_batch", "kv_utilization", "output_tokens_per_s", "num_preemptions",
                "recomputed_tokens", "mean_end_waste_tokens", "simulated_seconds",
                "wall_seconds", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                "steady_output_tokens_per_s", "steady_mean_batch"):
        assert key in d


@pytest.mark.parametrize("kwargs,field", [(dict(policy="lru"), "policy"),
                                          (dict(layout="diagonal"), "layout"),
                                          (dict(cache_bytes=0), "cache_bytes"),
                                          (dict(model="gpt-5"), "model")])
def test_bad_sim_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SimConfig(**kwargs)
