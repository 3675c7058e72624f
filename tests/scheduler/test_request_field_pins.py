"""Request and SchedulerConfig fields at the edges of their ranges: each bad value refused by a
ConfigError naming the field, the edge value itself accepted."""
import math

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.managers.prefix import SALT_MARK
from vmemkv.scheduler.plan import SchedulerConfig
from vmemkv.scheduler.request import Request, Sequence


@pytest.mark.parametrize("fields, field", [
    ({"max_tokens": 0}, "Request.max_tokens"),
    ({"n": 2, "beam_width": 2}, "Request.n"),
    ({"arrival_s": math.nan}, "Request.arrival_s"),
    ({"arrival_s": -0.5}, "Request.arrival_s"),
    ({"n": 0}, "Request.n"),
    ({"prefix_lookup": 1}, "Request.prefix_lookup"),
    ({"namespace": SALT_MARK + "tenant"}, "Request.namespace"),
])
def test_a_bad_request_field_is_refused_by_name(fields, field):
    with pytest.raises(ConfigError, match=field):
        Request(0, 4, **{"max_tokens": 1, **fields})


def test_the_smallest_request_and_a_beam_group_of_one_sample_are_accepted():
    assert Request(0, 1, 1).max_total_len == 2
    assert Request(1, 4, 1, beam_width=2, arrival_s=0.0).n == 1


def test_new_token_ids_span_the_prompt_and_the_output():
    seq = Sequence(0, Request(0, 3, 5, prompt_token_ids=(7, 8, 9)), output=[4, 5])
    assert seq.new_token_ids(1, 5) == (8, 9, 4, 5)     # a recompute's chunk across both
    assert seq.new_token_ids(0, 4) == (7, 8, 9, 4)
    assert seq.new_token_ids(3, 5) == (4, 5) and seq.token_ids() == [7, 8, 9, 4, 5]


def test_in_prefill_is_false_only_with_one_pending_decode_token():
    seq = Sequence(0, Request(0, 3, 5), output=[4])
    seq.num_computed = 3                  # the prompt cached, the sampled token pending
    assert not seq.in_prefill
    seq.num_computed = 2
    assert seq.in_prefill
    fresh = Sequence(1, Request(1, 1, 5))
    fresh.num_computed = 0
    assert fresh.in_prefill               # a one-token prompt: no output yet


def test_a_step_budget_one_below_max_running_is_refused_and_equal_accepted():
    with pytest.raises(ConfigError, match=r"SchedulerConfig.max_tokens_per_step.*max_running \(8\)"):
        SchedulerConfig(max_running=8, max_tokens_per_step=7)
    assert SchedulerConfig(max_running=8, max_tokens_per_step=8).max_tokens_per_step == 8
