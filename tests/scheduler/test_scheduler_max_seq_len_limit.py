"""``SchedulerConfig.max_seq_len`` past the manager's own is refused when the scheduler is
built, naming both: it was taken, and every request longer than the manager's limit then
refused saying "the cache holds N tokens of one sequence at most", N the manager's, not the
limit the user set. At or below the manager's, it is the limit requests are checked against."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.errors import ConfigError, RequestTooLargeError
from vmemkv.scheduler.managers import POLICIES, make_manager
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

TINY = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token


def _manager(policy):
    return make_manager(policy, TINY, 2 * 256, 16, block_size_tokens=4, page_bytes=4,
                        max_slots=4)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_limit_past_the_managers_is_refused_naming_both(policy):
    with pytest.raises(ConfigError) as refused:
        Scheduler(_manager(policy), SchedulerConfig(max_seq_len=64))
    assert str(refused.value) == ("SchedulerConfig.max_seq_len must be at most the manager's "
                                  "max_seq_len (16 tokens a sequence), got 64")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_limit_within_the_managers_is_the_one_requests_meet(policy):
    sched = Scheduler(_manager(policy), SchedulerConfig(max_seq_len=12))
    assert sched.max_seq_len == 12
    with pytest.raises(RequestTooLargeError, match="max_seq_len 12"):
        sched.add_request(Request(1, 8, 5))
    sched.add_request(Request(2, 8, 4))
    assert Scheduler(_manager(policy), SchedulerConfig(max_seq_len=16)).max_seq_len == 16
    assert Scheduler(_manager(policy)).max_seq_len == 16
