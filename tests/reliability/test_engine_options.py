"""EngineConfig's memory and bool options, and calls on a closed engine: each refused by name
before anything is built or changed."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, EngineConfig
from vmemkv.runtime.engine.errors import EngineClosedError, EngineConfigError
from vmemkv.runtime.errors import CacheConfigError

from .conftest import assert_words


MEMORY_UTILIZATION_CASES = [
    ("zero", dict(memory_utilization=0.0), ["memory_utilization", "(0, 1]", "0.0"]),
    ("above-one", dict(memory_utilization=1.5), ["memory_utilization", "(0, 1]", "1.5"]),
    ("nan", dict(memory_utilization=float("nan")), ["memory_utilization", "nan"]),
    ("bool", dict(memory_utilization=True), ["memory_utilization", "True"]),
    ("with-cache-bytes", dict(memory_utilization=0.5, cache_bytes=1 << 20),
     ["cache_bytes (1048576)", "memory_utilization (0.5)", "exclusive"]),
    ("self-check-not-bool", dict(self_check="no"), ["EngineConfig.self_check", "'no'"]),
    ("prefix-sharing-not-bool", dict(prefix_sharing="yes"), ["EngineConfig.prefix_sharing", "'yes'"]),
    ("mapper-not-bool", dict(background_mapper=1), ["EngineConfig.background_mapper", "1"]),
    ("integrity-not-bool", dict(check_integrity="x"), ["EngineConfig.check_integrity", "'x'"]),
]


@pytest.mark.parametrize("fields,words", [pytest.param(*c[1:], id=c[0]) for c in MEMORY_UTILIZATION_CASES])
def test_memory_utilization_and_self_check_are_validated(fields, words):
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(**fields)
    assert_words(info.value, words)


def test_a_memory_utilization_of_less_than_a_byte_names_it(model):
    with pytest.raises(CacheConfigError) as info:
        Engine(model, memory_utilization=1e-300)
    assert_words(info.value, ["memory_utilization=1e-300", "less than a byte"])


def test_add_lora_after_close_is_refused_as_every_other_call(model):
    """add_lora loaded an adapter into a closed engine (add_request and sleep refused)."""
    eng = Engine(model, max_batch=1, max_context=32)
    eng.close()
    with pytest.raises(EngineClosedError):
        eng.add_lora("a", "/nonexistent")
    assert eng.loras == []
