"""Every ``SchedulerConfig`` field is checked by name (``enable_prefix_sharing="no"`` turned
sharing on, ``max_seq_len=0`` or NaN was ignored, ``watermark=None`` a TypeError), and a
``TraceEntry``'s token counts are ints, not bools (``output_len=True`` ran as 1 token) nor NaN
(blamed on the simulation's memory)."""
from __future__ import annotations

import math

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.plan import SchedulerConfig
from vmemkv.scheduler.trace_entry import TraceEntry, parse_trace_object


@pytest.mark.parametrize("field, value, words", [
    ("enable_prefix_sharing", "no", "must be True or False, got 'no'"),
    ("enable_prefix_sharing", 1, "must be True or False, got 1"),
    ("check_every_step", "yes", "must be True or False, got 'yes'"),
    ("check_every_step", None, "must be True or False, got None"),
    ("max_seq_len", 0, "must be an int >= 1, got 0"),
    ("max_seq_len", math.nan, "must be an int >= 1, got nan"),
    ("max_seq_len", "3", "must be an int >= 1, got '3'"),
    ("max_seq_len", True, "must be an int >= 1, got True"),
    ("max_seq_len", 64.0, "must be an int >= 1, got 64.0"),
    ("watermark", None, "must be a fraction in [0, 1), got None"),
    ("watermark", math.nan, "must be a fraction in [0, 1), got nan"),
    ("watermark", True, "must be a fraction in [0, 1), got True"),
    ("watermark", "0.1", "must be a fraction in [0, 1), got '0.1'"),
    ("watermark", 1.0, "must be a fraction in [0, 1), got 1.0"),
    ("max_running", True, "must be an int >= 1, got True"),
    ("max_running", 2.0, "must be an int >= 1, got 2.0"),
    ("max_tokens_per_step", True, "must be an int >= 1, got True"),
    ("max_tokens_per_step", 10, "must be an int >= max_running (1024) so every decode fits a "
                                "step, got 10"),
    ("preemption", ["swap"], "must be one of recompute, swap, got ['swap']"),
])
def test_a_scheduler_config_field_is_refused_by_name(field, value, words):
    with pytest.raises(ConfigError) as refused:
        SchedulerConfig(**{field: value})
    assert str(refused.value) == f"SchedulerConfig.{field} {words}"


def test_good_scheduler_configs_keep_their_values():
    config = SchedulerConfig(max_running=4, max_tokens_per_step=4, watermark=0,
                             preemption="swap", enable_prefix_sharing=True,
                             check_every_step=False, max_seq_len=1)
    assert (config.max_running, config.watermark, config.enable_prefix_sharing,
            config.max_seq_len) == (4, 0, True, 1)
    assert SchedulerConfig(max_seq_len=None, watermark=0.5).max_seq_len is None


@pytest.mark.parametrize("field", ["prompt_len", "output_len"])
@pytest.mark.parametrize("value, shown", [(True, "True"), (False, "False"), (math.nan, "nan"),
                                          ("5", "'5'"), (0, "0"), (5.0, "5.0"),
                                          (10**9 + 1, "1000000001")])
def test_a_trace_entry_token_count_is_an_int_in_range(field, value, shown):
    counts = {"prompt_len": 100, "output_len": 20, field: value}
    with pytest.raises(ConfigError) as refused:
        TraceEntry(counts["prompt_len"], counts["output_len"], 0.0)
    assert str(refused.value) == f"TraceEntry.{field} must be an int in [1, 1,000,000,000], got {shown}"


def test_a_trace_line_is_still_named_by_where_it_is():
    assert TraceEntry(1, 10**9, 0.0).total_len == 10**9 + 1
    with pytest.raises(ConfigError) as refused:
        parse_trace_object({"prompt_len": 5, "output_len": True, "arrival_s": 0}, "t.jsonl line 3")
    assert str(refused.value) == ("t.jsonl line 3: output_len must be an int in "
                                  "[1, 1,000,000,000], got True")
