"""The simulated beam forks of a request are the same under every policy: each request's parents
after an output step are drawn from a generator keyed by (beam_seed, request id, step), not
from one stream read in the order a policy schedules the groups (40 of 40 requests forked
differently under paged and reserve-max); and ``beam_seed`` changes them (it was always 0)."""
from __future__ import annotations

import pytest

from vmemkv.scheduler import simulator
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.simulator import BeamModel, SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

ENTRIES = generate(WorkloadSpec(num_requests=24, prompt_median=60, prompt_p95=200, output_mean=30,
                                output_p95=80, max_total_len=512, seed=3))


def forks(monkeypatch, policy: str, **options) -> dict:
    """(request id, step) -> the parents drawn, of one beam-width-4 run of ``ENTRIES``."""
    drawn: dict = {}

    class Recording(BeamModel):
        def parents(self, live, *key):
            ranks = super().parents(live, *key)
            drawn.setdefault(key, []).append(ranks)
            return ranks
    monkeypatch.setattr(simulator, "BeamModel", Recording)
    result = simulate(ENTRIES, SimConfig(policy=policy, cache_bytes=int(0.5e9), max_seq_len=512,
                                         page_bytes=2**16, beam_width=4, **options))
    assert result.num_requests == len(ENTRIES)
    return drawn


def test_every_policy_sees_the_same_forks_for_the_same_request(monkeypatch):
    paged = forks(monkeypatch, "paged")
    assert len(paged) == sum(e.output_len - 1 for e in ENTRIES)   # a draw per step but the last
    assert all(len(ranks) == 1 for ranks in paged.values())       # each drawn once
    for policy in ("reserve-max", "vmem"):
        assert forks(monkeypatch, policy) == paged, policy


def test_the_beam_seed_changes_the_forks_and_is_checked(monkeypatch):
    first, again = forks(monkeypatch, "paged"), forks(monkeypatch, "paged", beam_seed=0)
    other = forks(monkeypatch, "paged", beam_seed=1)
    assert first == again and other.keys() == first.keys()
    assert sum(other[key] != first[key] for key in first) > len(first) // 2
    with pytest.raises(ConfigError, match="beam_seed must be an int >= 0, got -1"):
        SimConfig(beam_seed=-1)


def test_a_draw_depends_on_its_key_not_on_the_draws_before_it():
    model = BeamModel(4, seed=7)
    keys = [(rid, step) for rid in range(5) for step in range(6)]
    ahead = {key: model.parents(4, *key) for key in keys}
    assert {key: model.parents(4, *key) for key in reversed(keys)} == ahead
    assert BeamModel(4, seed=7).parents(4, 3, 2) == ahead[3, 2]
    assert len({tuple(ranks) for ranks in ahead.values()}) > 5      # not one draw repeated
