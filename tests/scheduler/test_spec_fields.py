"""Hand-made workloads and specs the simulator cannot run are ConfigErrors naming the field
(or the entry) before anything is drawn or simulated: a NaN arrival anywhere in the list (it
hung the run loop for ever when it was not first), a seed that is not an int >= 0 (None drew a
different workload on every call), counts and rates of the wrong type."""
import math

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import (LoraSpec, TraceEntry, WorkloadSpec, check_arrivals,
                                       lora_workload)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, -math.inf])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_bad_arrival_anywhere_is_refused_naming_its_entry(bad, where):
    entries = [TraceEntry(100, 5, 0.0) for _ in range(3)]
    entries[where] = TraceEntry(100, 5, bad)
    with pytest.raises(ConfigError, match=rf"arrival_s: entry {where} arrives at {bad!r} s; "
                                          r"an arrival must be a finite number of seconds"):
        simulate(entries, SimConfig(cache_bytes=2 * 10**9))   # a NaN not first: ran for ever
    with pytest.raises(ConfigError, match=rf"entry {where} arrives"):
        check_arrivals(entries)


@pytest.mark.parametrize("seed", [None, -1, 1.5, "a", True])
def test_a_seed_that_names_no_single_workload_is_refused(seed):
    with pytest.raises(ConfigError, match=rf"WorkloadSpec.seed must be an int >= 0, got "
                                          rf"{seed!r}"):
        WorkloadSpec(num_requests=5, seed=seed)
    with pytest.raises(ConfigError, match=rf"LoraSpec.seed must be an int >= 0, got {seed!r}"):
        lora_workload(WorkloadSpec(num_requests=5), LoraSpec(3, seed=seed),
                      get_model("llama-3-8b"))


@pytest.mark.parametrize("field, value, match", [
    ("num_requests", True, r"WorkloadSpec.num_requests must be an int >= 1, got True"),
    ("max_total_len", 4096.0, r"WorkloadSpec.max_total_len must be an int >= 2, got 4096.0"),
    ("arrival_rate", "5", r"WorkloadSpec.arrival_rate must be a finite number of requests/s "
                          r">= 0, got '5'"),
    ("arrival_rate", None, r"WorkloadSpec.arrival_rate must be .* got None"),
    ("arrival_rate", math.inf, r"WorkloadSpec.arrival_rate must be .* got inf"),
    ("arrival_rate", -1.0, r"WorkloadSpec.arrival_rate must be .* got -1.0"),
])
def test_workload_spec_fields_of_the_wrong_type_are_config_errors(field, value, match):
    with pytest.raises(ConfigError, match=match):
        WorkloadSpec(**{field: value})


def test_a_seeded_workload_is_the_same_on_every_call():
    from vmemkv.scheduler.workload import generate
    assert generate(WorkloadSpec(num_requests=5, seed=0)) == generate(
        WorkloadSpec(num_requests=5, seed=0))
