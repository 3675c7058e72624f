"""Several models on one device in the simulator (scheduler/shared_sim.py): the budget's bytes
never exceed the device's and always equal the caches'; no request is lost; one model alone on
a budget that never moves is the plain simulator; a model bursting while the other is idle
gets its first tokens sooner from a shared budget than from a static split."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.presets import get_device, get_model
from vmemkv.scheduler.report import serving_report
from vmemkv.scheduler.shared_sim import SharedConfig, kv_bytes_after_weights, simulate_shared
from vmemkv.scheduler.shared_workloads import BurstySpec, bursty_workload, shifted_traces
from vmemkv.scheduler.simulator import simulate
from vmemkv.scheduler.traces import load_trace
from vmemkv.scheduler.workload import TraceEntry, WorkloadSpec

GB = 10**9
SMALL = WorkloadSpec(prompt_median=300, prompt_p95=1200, output_mean=200, output_p95=600,
                     max_total_len=2048)


def _checked(workloads, config):
    seen = []

    def check(sim, lane):
        held = sum(q.manager.cache_bytes for q in sim.lanes)
        assert held <= sim.total_bytes
        if sim.budget is not None:
            assert sim.budget.held_bytes == held
            assert all(q.share.held_bytes == q.manager.cache_bytes for q in sim.lanes)
        seen.append(held)
    result = simulate_shared(workloads, config, on_step=check)
    assert seen and max(seen) <= result.peak_held_bytes <= result.total_bytes
    for name, entries in workloads.items():
        assert result.models[name].num_requests == len(entries)     # every one finished
    return result


def test_a_model_bursting_while_the_other_is_idle_gets_its_tokens_sooner_from_a_budget():
    spec = BurstySpec(duration_s=40, period_s=40, burst_fraction=0.25, burst_rate=30,
                      quiet_rate=0.0, seed=3, lengths=SMALL)
    workloads = bursty_workload(spec)
    assert {k: len(v) for k, v in workloads.items()} == {"a": 271, "b": 287}
    common = dict(total_bytes=4 * GB, min_fraction=0.1, idle_release_s=1.0, max_seq_len=2048)
    static = _checked(workloads, SharedConfig(elastic=False, **common))
    shared = _checked(workloads, SharedConfig(elastic=True, **common))
    assert static.models["a"].peak_cache_bytes <= 2 * GB
    assert shared.models["a"].peak_cache_bytes > 3 * GB       # it grew into b's give-back
    assert shared.models["b"].gives >= 1 and shared.models["a"].grows >= 1
    assert shared.overall["ttft_p90_s"] < static.overall["ttft_p90_s"] / 10   # 3.26 -> 0.06 s
    assert shared.models["a"].ttft_p90_s < static.models["a"].ttft_p90_s
    assert shared.overall["output_tokens"] == static.overall["output_tokens"]


def test_resizes_count_the_pages_each_way_and_keep_the_models_stream_busy():
    """pages_created counts what each grow took into service and pages_released what each
    give returned (never netted against each other), and their time runs before the model's
    next step: a slower page creation delays b's first tokens."""
    spec = BurstySpec(duration_s=10, period_s=10, burst_fraction=0.25, burst_rate=30,
                      quiet_rate=0.0, seed=3, lengths=SMALL)
    workloads = bursty_workload(spec)
    common = dict(total_bytes=4 * GB, min_fraction=0.1, idle_release_s=1.0, max_seq_len=2048)
    initial = simulate_shared(workloads, SharedConfig(elastic=False, **common)).models
    fast = simulate_shared(workloads, SharedConfig(elastic=True, **common)).models
    slow = simulate_shared(workloads, SharedConfig(elastic=True, grow_page_s=0.01, **common)).models
    page = SharedConfig().page_bytes
    assert fast["b"].pages_created > 0 and fast["a"].pages_released > 0
    for name, model in fast.items():
        start = initial[name].final_cache_bytes
        assert model.pages_created * page >= model.peak_cache_bytes - start
        net_bytes = model.final_cache_bytes - start
        assert (model.pages_created - model.pages_released) * page == net_bytes
    assert slow["b"].resize_seconds > fast["b"].resize_seconds + 1
    assert slow["b"].ttft_p90_s > fast["b"].ttft_p90_s + 1


def test_the_overall_figures_are_the_models_counts_summed_and_latencies_pooled_in_seconds():
    spec = BurstySpec(duration_s=10, period_s=10, burst_fraction=0.25, burst_rate=30,
                      quiet_rate=0.0, seed=3, lengths=SMALL)
    result = simulate_shared(bursty_workload(spec), SharedConfig(
        elastic=True, total_bytes=GB, min_fraction=0.1, idle_release_s=1.0, max_seq_len=2048))
    models = result.models.values()
    assert all(m.num_preemptions > 0 for m in models)
    for key in ("num_requests", "output_tokens", "num_preemptions", "failed_requests", "grows",
                "gives"):
        assert result.overall[key] == sum(getattr(m, key) for m in models), key
    pooled = serving_report([t for m in models for t in m.timings], percentiles=(50.0, 90.0))
    for q in (50, 90):
        assert result.overall[f"ttft_p{q}_s"] == pytest.approx(pooled[f"p{q}_ttft_ms"] / 1e3)


def test_one_model_on_a_budget_that_never_moves_is_the_plain_simulator():
    entries = bursty_workload(BurstySpec(models=("a",), duration_s=20, period_s=20,
                                         burst_rate=6, seed=1, lengths=SMALL))["a"]
    config = SharedConfig(elastic=True, total_bytes=4 * GB, min_fraction=1.0, max_seq_len=2048)
    shared = _checked({"a": entries}, config)
    assert shared.overall["grows"] == shared.overall["gives"] == 0
    plain = simulate(entries, config.sim_config("llama-3-8b", 4 * GB))
    lane = shared.models["a"]
    assert (lane.output_tokens, lane.num_steps, lane.num_preemptions) == \
        (plain.output_tokens, plain.num_steps, plain.num_preemptions)
    assert lane.ttft_p90_s == pytest.approx(plain.report()["p90_ttft_ms"] / 1e3, rel=1e-9)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), rate=st.floats(2, 15), total_gb=st.integers(2, 8),
       min_fraction=st.sampled_from([0.0, 0.1, 0.4]), idle=st.sampled_from([0.0, 0.5, 3.0]))
def test_random_bursts_keep_the_budget_whole_and_lose_nothing(seed, rate, total_gb,
                                                              min_fraction, idle):
    workloads = bursty_workload(BurstySpec(duration_s=12, period_s=8, burst_rate=rate,
                                           quiet_rate=1.0, seed=seed, lengths=SMALL))
    _checked(workloads, SharedConfig(elastic=True, total_bytes=total_gb * GB,
                                     min_fraction=min_fraction, idle_release_s=idle,
                                     max_seq_len=2048))


def test_the_device_memory_and_the_workload_are_checked_by_name():
    assert kv_bytes_after_weights("h100", ("llama-3-8b",) * 2) == \
        get_device("h100").memory_bytes - 2 * get_model("llama-3-8b").weight_bytes
    with pytest.raises(ConfigError, match="do not fit"):
        kv_bytes_after_weights("h100", ("llama-3-8b",) * 6)
    with pytest.raises(ConfigError, match="burst_fraction"):
        BurstySpec(burst_fraction=0)
    with pytest.raises(ConfigError, match="at least one workload"):
        simulate_shared({})


def test_shifted_traces_replay_each_trace_later_than_the_one_before_and_fit_its_lengths():
    lanes = shifted_traces({"a": "azure-code", "b": "azure-code", "c": "azure-conv"}, shift_s=30.0,
                           max_requests=50, max_total_len=1024)
    code = load_trace("azure-code", max_requests=50)
    assert [len(v) for v in lanes.values()] == [50, 50, 50]
    assert [e.arrival_s for e in lanes["a"]] == [e.arrival_s for e in code]
    assert [e.arrival_s for e in lanes["b"]] == [e.arrival_s + 30.0 for e in code]
    assert lanes["c"][0].arrival_s == load_trace("azure-conv", max_requests=1)[0].arrival_s + 60.0
    assert max(e.total_len for e in code) > 1024                 # some were cut, none is over
    assert all(e.total_len <= 1024 for lane in lanes.values() for e in lane)
    with pytest.raises(ConfigError, match="max_total_len"):
        shifted_traces({"a": "azure-code"}, shift_s=1.0, max_total_len=1)


def _two_long_requests_after_bursts():
    """Each model first bursts alone (so each has held most of the 1 GiB: 8,192 tokens of
    Llama-3-8B), then both get one request of 5,500 tokens at the same moment."""
    burst = lambda t0: [TraceEntry(1000, 500, t0 + 0.01 * i) for i in range(12)]   # noqa: E731
    return {"a": burst(0.0) + [TraceEntry(100, 5400, 200.0)],
            "b": burst(100.0) + [TraceEntry(100, 5400, 200.0)]}


def test_two_models_each_needing_more_than_half_the_budget_both_finish():
    """Both grew part way and each waited for the other's pages for ever (simulate_shared
    never returned); now the younger yields to the older (budget.py's liveness rule)."""
    config = SharedConfig(elastic=True, total_bytes=1 << 30, min_fraction=0.05,
                          idle_release_s=2.0, max_seq_len=8192)
    result = _checked(_two_long_requests_after_bursts(), config)
    assert {n: (m.output_tokens, m.failed_requests) for n, m in result.models.items()} == \
        {"a": (11400, 0), "b": (11400, 0)}
    assert max(m.peak_cache_bytes for m in result.models.values()) > (1 << 30) // 2


def test_a_run_that_stops_moving_is_a_stall_error_naming_each_lane(monkeypatch):
    """The budget's rule made to never grow (as the deadlock did): the run ends by a typed
    error naming what each lane waits for, at once (every lane waits and no event is left),
    not an endless loop. Each lane's 5,500-token request waits within its reach (it was
    refused as "can never fit" against the most its pool had held: a's 0 waiting, b's 12)."""
    from vmemkv.scheduler.budget import BudgetShare
    from vmemkv.scheduler.shared_sim import SharedSimulator, SimulationStalledError
    decide = BudgetShare.decide

    def never_grows(self, *args, **kwargs):
        target = decide(self, *args, **kwargs)
        return None if target is not None and target > self.held_bytes else target
    monkeypatch.setattr(BudgetShare, "decide", never_grows)
    sim = SharedSimulator(_two_long_requests_after_bursts(),
                          SharedConfig(elastic=True, total_bytes=1 << 30, min_fraction=0.05,
                                       max_seq_len=8192))
    turns = []
    with pytest.raises(SimulationStalledError, match=r"every model waits and none has an "
                       r"event left .*"
                       r"a: 1 waiting, 0 running, 0 swapped, cache \d+ bytes, head sequence "
                       r"12 of \d+ tokens; .*; b: 13 waiting, 0 running, 0 "
                       r"swapped, cache \d+ bytes, head sequence 0 of 1000 tokens; share min "
                       r"\d+ max 1073741824, blocked asking \d+"):
        sim.run(on_step=lambda s, lane: turns.append(1))
    assert len(turns) < sim.stall_turns      # found when it happens, not turns later


@pytest.mark.parametrize("idle_release_s", [2.0, 60.0])
def test_an_idle_model_gives_at_once_to_pressure_and_a_blocked_one_waits_without_spinning(
        idle_release_s):
    """a (idle, shrunk to its minimum) gets a 1,950-token request while b, idle again after a
    burst, holds most of the budget: b ticked only at its idle deadline (pressure posted after
    its tick was ignored), a stepped empty meanwhile (3.7 ms each), and with a 60 s deadline
    the run was a SimulationStalledError after 10,256 turns though nothing was stuck."""
    wl = {"a": [TraceEntry(1900, 50, idle_release_s + 2.0)],
          "b": [TraceEntry(1500, 20, idle_release_s + 0.5 + 0.001 * i) for i in range(4)]}
    config = SharedConfig(total_bytes=2**29, idle_release_s=idle_release_s,
                          model="llama-3-8b", page_bytes=2 * 2**20)
    turns = []
    result = simulate_shared(wl, config, on_step=lambda s, lane: turns.append(lane.name))
    a = result.models["a"]
    assert (a.output_tokens, a.failed_requests) == (50, 0)
    assert a.ttft_p50_s < 0.1 and len(turns) < 300


@pytest.mark.parametrize("new_tokens,a_counts", [(5900, (0, 2, 5920)), (7900, (1, 1, 20))])
def test_a_request_longer_than_its_pool_has_held_runs_within_its_reach_else_fails_alone(
        new_tokens, a_counts):
    """6,000 tokens fit what a's share can reach (1 GiB less b's 5% minimum: 7,782 tokens)
    though a's pool has held 4,096: it runs (it was refused against those 4,096). 8,000 are
    past the reach though within the device (8,192): refused alone, the run goes on (the whole
    run had ended in RequestTooLargeError)."""
    workloads = {"a": [TraceEntry(100, new_tokens, 0.0), TraceEntry(100, 20, 1.0)],
                 "b": [TraceEntry(100, 10, 0.0)]}
    result = simulate_shared(workloads, SharedConfig(elastic=True, total_bytes=1 << 30,
                                                     min_fraction=0.05, max_seq_len=8192))
    a, b = result.models["a"], result.models["b"]
    assert (a.failed_requests, a.num_requests, a.output_tokens) == a_counts
    assert (b.failed_requests, b.num_requests, b.output_tokens) == (0, 1, 10)
    assert result.overall["failed_requests"] == a_counts[0]
