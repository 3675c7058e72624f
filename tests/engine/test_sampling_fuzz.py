"""SamplingParams over edge floats and sizes (subnormals, ±0, inf, nan, 1e±308): each either
refused with a typed error naming the field, or run beside a greedy victim whose tokens equal
its solo run; never an untyped exception, never a change to the victim (issue 27)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineError

from .conftest import model

EDGE = [0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1e-300, 1e-38, 1e-7, 0.5, 1.0, 2.0, 1e308,
        -1e308, math.inf, -math.inf, math.nan, -1.0, 0, 1, True, "0.5", None]
# Tiny temperatures and top_p overflowed the sampler's fp32 division (issue 27 item 1); fixed on
# the real-models branch (a temperature below 1e-5 is greedy, top_p keeps the likeliest token):
# in the fuzz now, and pinned by the test below.
SAMPLER_NUMERICS = [{"temperature": 5e-324}, {"temperature": 1e-300}, {"temperature": 1e-38},
                    {"temperature": 0.5, "top_p": 5e-324}, {"temperature": 0.5, "top_p": 1e-300}]
VICTIM = [7, 3, 9, 200, 11, 5]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


values = st.sampled_from(EDGE) | st.floats(allow_nan=True, allow_infinity=True)
PARAMS = st.fixed_dictionaries({}, optional={
    "temperature": values, "top_p": values, "top_k": st.sampled_from([-1, 0, 1, 5, 2**63]) | values,
    "max_new_tokens": st.sampled_from([0, 1, 3, 2**63, -1]) | values,
    "n": st.sampled_from([0, 1, 2, 3]) | values, "seed": st.sampled_from([None, 0, -1, 2**64]) | values,
    "stop_token_ids": st.sampled_from([(), (1, 2), (1.5,), "ab", (True,)]),
})


@pytest.fixture(scope="module")
def engine():
    with Engine(model(), cache="paged", block_size=8, max_batch=4, max_context=64) as eng:
        yield eng


@pytest.fixture(scope="module")
def solo(engine):
    return engine.generate([VICTIM], GREEDY)[0].outputs[0].token_ids


def beside_victim(engine, kwargs: dict):
    """The victim's tokens when run in one batch with a request of ``kwargs``; None when
    ``SamplingParams(**kwargs)`` or its request is refused (a typed error, nothing queued)."""
    try:
        params = SamplingParams(**kwargs)
        outputs = engine.generate([VICTIM, [1, 2, 3]], [GREEDY, params])
    except EngineError as error:
        assert isinstance(error, ValueError) and str(error)   # typed, with a message
        assert not engine.has_unfinished()
        return None
    return outputs[0].outputs[0].token_ids


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(kwargs=PARAMS)
def test_fuzzed_sampling_params_are_refused_typed_or_leave_the_victim_alone(engine, solo, kwargs):
    victim = beside_victim(engine, kwargs)
    assert victim is None or victim == solo, kwargs


def test_tiny_temperatures_and_top_p_are_sampled_or_refused(solo):
    for kwargs in SAMPLER_NUMERICS:    # a fresh engine each: on main they left it failing for good
        with Engine(model(), cache="paged", block_size=8, max_batch=4, max_context=64) as eng:
            assert beside_victim(eng, kwargs) in (None, solo), kwargs
