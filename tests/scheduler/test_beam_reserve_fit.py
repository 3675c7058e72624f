"""A beam search under a reserve policy: each beam is a sequence holding its own reservation
(a fork copies the parent's: nothing is shared), so from its first decode step the group holds
``beam_width`` of them. A group they can never fit was admitted, preempted and recomputed step
after step until it failed (4 preemptions and 1,588 recomputed tokens for 4 such requests);
it is now refused at add time, as paged and vmem refuse a group that can never run, naming
``beam_width``; a group that fits exactly runs."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import MODELS
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

SPEC = MODELS["llama-3-8b"]
MAX_LEN = 512


def scheduler(policy: str, reservations: int) -> Scheduler:
    """A reserve policy whose cache holds ``reservations`` max_seq_len reservations."""
    manager = make_manager(policy, SPEC, reservations * MAX_LEN * SPEC.bytes_per_token, MAX_LEN)
    return Scheduler(manager, SchedulerConfig())


@pytest.mark.parametrize("policy, prompt, max_tokens, width, fits", [
    ("reserve-max", 10, 5, 4, False),       # 4 x 512 > 2 x 512
    ("reserve-max", 10, 5, 2, True),        # exactly two reservations
    ("reserve-oracle", 200, 56, 4, True),   # 4 x 256 = 1024: exactly
    ("reserve-oracle", 200, 57, 4, False),  # 4 x 257 > 1024
    ("reserve-max", 10, 1, 4, True),        # one token: no beam ever forks
])
def test_a_group_of_more_reservations_than_the_cache_holds_is_refused_at_add(
        policy, prompt, max_tokens, width, fits):
    sched = scheduler(policy, 2)
    request = Request(0, prompt, max_tokens, beam_width=width)
    if fits:
        sched.add_request(request)
        assert len(sched.waiting) == 1            # queued: the group starts as its prompt
        return
    with pytest.raises(RequestTooLargeError, match=rf"a beam search of {width} beams holds "
                       rf"{width} reservations of \d+ tokens \({policy}: a fork copies") as refused:
        sched.add_request(request)
    assert refused.value.field == "beam_width"
    assert not sched.seqs and not sched.waiting


def test_the_simulator_refuses_it_before_running_and_runs_a_group_that_fits():
    entries = generate(WorkloadSpec(num_requests=4, prompt_median=60, prompt_p95=200,
                                    output_mean=30, output_p95=80, max_total_len=MAX_LEN, seed=3))
    two = 2 * MAX_LEN * SPEC.bytes_per_token
    with pytest.raises(RequestTooLargeError, match="beam search of 4 beams holds 4 reservations"):
        simulate(entries, SimConfig(policy="reserve-max", cache_bytes=two, max_seq_len=MAX_LEN,
                                    beam_width=4))
    result = simulate(entries, SimConfig(policy="reserve-max", cache_bytes=two,
                                         max_seq_len=MAX_LEN, beam_width=2))
    assert result.num_requests == 4 and result.failed_requests == 0
