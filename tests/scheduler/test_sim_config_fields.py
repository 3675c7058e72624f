"""SimConfig and CostModel refuse, naming the field, what no deployment has: sizes and knobs of
the wrong type, infinite or zero, before anything is built or simulated (they escaped as
OverflowError / TypeError, as a host-memory error that named no field, or ran to a NaN)."""
import math

import pytest

from vmemkv.scheduler.cost import CostModel
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.presets import get_device, get_model
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry


@pytest.mark.parametrize("fields, match", [
    (dict(cache_bytes=math.inf), r"cache_bytes must be a finite number of bytes > 0, got inf"),
    (dict(cache_bytes="2e9"), r"cache_bytes must be a finite number of bytes > 0, got '2e9'"),
    (dict(cache_bytes=math.nan), r"cache_bytes must be .* got nan"),
    (dict(swap_bytes=math.inf), r"swap_bytes must be a finite number of bytes >= 0, got inf"),
    (dict(prefill_mfu="0.5"), r"prefill_mfu must be None or a number in \(0, 1\], got '0.5'"),
    (dict(map_latency_s=math.inf), r"map_latency_s must be a finite number of seconds >= 0, "
                                   r"got inf"),
    (dict(block_size=0), r"block_size must be an int >= 1, got 0"),
    (dict(policy="vmem", page_bytes=0), r"page_bytes must be an int >= 1, got 0"),
    (dict(max_seq_len=4096.0), r"max_seq_len must be an int >= 1, got 4096.0"),
    (dict(beam_skew=math.inf), r"beam_skew must be a finite number >= 0, got inf"),
    (dict(copy_bytes_per_s=math.inf), r"copy_bytes_per_s must be a finite number of bytes/s > 0"),
])
def test_a_bad_sim_config_field_is_refused_by_name_before_running(fields, match):
    with pytest.raises(ConfigError, match=match):
        simulate([TraceEntry(100, 5, 0.0)], SimConfig(**{"cache_bytes": 4 * 10**9, **fields}))


@pytest.mark.parametrize("fields, match", [
    (dict(prefill_mfu="0.5"), r"prefill_mfu must be None or a number in \(0, 1\], got '0.5'"),
    (dict(prefill_mfu=True), r"prefill_mfu must be None or a number in \(0, 1\], got True"),
    (dict(map_latency_s=math.inf), r"map_latency_s must be a finite number of seconds >= 0"),
    (dict(kv_slowdown=math.inf), r"kv_slowdown must be a finite number >= 1, got inf"),
    (dict(pages_per_map_op=True), r"pages_per_map_op must be an int >= 1, got True"),
])
def test_a_bad_cost_model_field_is_refused_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        CostModel(get_model("llama-3-8b"), get_device("h100"), **fields)


def test_a_float_cache_size_still_runs():
    result = simulate([TraceEntry(100, 5, 0.0)], SimConfig(cache_bytes=4e9))
    assert result.num_requests == 1
