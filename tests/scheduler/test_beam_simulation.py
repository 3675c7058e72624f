"""The simulator's beam search (``beam_width``): every request finishes on every policy, each
beam samples every step (width x output tokens per request), the run is reproducible, and the
sharing policies' throughput gain over reserve-max grows with the width (the PagedAttention
paper's trend)."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.simulator import BeamModel, SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

ENTRIES = generate(WorkloadSpec(num_requests=40, prompt_median=60, prompt_p95=200, output_mean=40,
                                output_p95=120, max_total_len=512, seed=3))
CACHE = int(0.5e9)   # llama-3-8b at 128 KiB a token: ~3,800 tokens, memory-bound


def run(policy: str, width: int, **options):
    return simulate(ENTRIES, SimConfig(policy=policy, cache_bytes=CACHE, max_seq_len=512,
                                       page_bytes=2**16, beam_width=width, **options))


@pytest.mark.parametrize("policy", ["reserve-max", "paged", "vmem"])
def test_every_beam_samples_every_step_and_every_request_finishes(policy):
    result = run(policy, 3)
    assert result.num_requests == len(ENTRIES)
    assert result.output_tokens == sum(3 * e.output_len if e.output_len > 1 else 1
                                       for e in ENTRIES)


def test_a_beam_run_is_reproducible_and_the_gain_over_reserve_max_grows_with_width():
    first, again = run("paged", 4).to_dict(), run("paged", 4).to_dict()
    first.pop("wall_seconds"), again.pop("wall_seconds")
    assert first == again
    gains = []
    for width in (1, 4):
        rates = {p: len(ENTRIES) / run(p, width).simulated_seconds for p in ("reserve-max", "paged")}
        gains.append(rates["paged"] / rates["reserve-max"])
    assert gains[1] > gains[0] > 1.0


def test_beam_model_spreads_children_by_skew_and_bad_configs_are_refused():
    assert BeamModel(6, skew=50.0).parents(4) == [0] * 6       # all on the best beam
    spread = BeamModel(400, skew=0.0, seed=1).parents(4)
    assert all(80 <= spread.count(r) <= 120 for r in range(4))
    with pytest.raises(ConfigError, match="beam_width"):
        SimConfig(beam_width=-1)
    with pytest.raises(ConfigError, match="beam_skew"):
        SimConfig(beam_skew=-0.5)


def test_parallel_samples_each_sample_every_token_and_share_the_prompt():
    """``n`` samples per request: n x output tokens each, forks share the prompt's memory (the
    saving grows with n), and without forks there is no saving to report."""
    big = int(4e9)     # room for every request at once: no preemption, so no private recompute
    plain = simulate(ENTRIES, SimConfig(policy="paged", cache_bytes=big, max_seq_len=512))
    assert plain.sharing_saved is None
    saved = {}
    for n in (2, 4):
        result = simulate(ENTRIES, SimConfig(policy="paged", cache_bytes=big, max_seq_len=512, n=n))
        assert result.num_preemptions == 0
        assert result.output_tokens == sum(n * e.output_len if e.output_len > 1 else n
                                           for e in ENTRIES)
        saved[n] = result.sharing_saved
    assert 0 < saved[2] < saved[4] < 1 - 1 / 4, saved       # never more than the n copies
    assert run("reserve-max", 3).sharing_saved == 0.0       # reserves share nothing


def test_beam_runs_report_the_memory_sharing_saves_on_both_sharing_policies():
    for policy in ("paged", "vmem"):
        assert 0.2 < run(policy, 4).sharing_saved < 0.75


def test_n_is_refused_by_name_when_it_cannot_be_computed():
    with pytest.raises(ConfigError, match="n must be an int >= 1"):
        SimConfig(n=0)
    with pytest.raises(ConfigError, match="n must be 1 with beam_width"):
        SimConfig(n=2, beam_width=2)


def test_a_beam_search_that_stops_fitting_fails_alone_and_the_run_goes_on():
    """Diverging beams each copy their newest page: a group can outgrow a small cache at run
    time, which no add-time check can foresee. The whole simulation used to end there
    (RequestTooLargeError, no results); now that request ends "failed", as the engine ends it,
    and the others finish. The same workload without it: none fails."""
    from vmemkv.scheduler.scheduler import SchedulerConfig
    config = SimConfig(policy="vmem", cache_bytes=9 * 10**8, beam_width=4,
                       scheduler=SchedulerConfig(watermark=0.01))
    entries = generate(WorkloadSpec(num_requests=20))
    result = simulate(entries, config)
    assert result.failed_requests == 3 and result.num_requests == 17
    assert result.serving["completed"] == 17
    again = simulate(entries, config)                      # reproducible
    assert (again.failed_requests, again.output_tokens) == (3, result.output_tokens)
