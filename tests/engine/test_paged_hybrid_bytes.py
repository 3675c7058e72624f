"""A paged hybrid's stats count tokens of one block group at that group's bytes: the pool's
bytes (the manager's ``cache_bytes`` and ``EngineStats.cache_bytes``) are those, not the group
tokens at a whole token's bytes (tiny-gemma3's six one-layer groups: six times too many)."""
import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from ..vmem_only_options import options_for
from .conftest import model

KiB = 1024


@pytest.mark.parametrize("cache", ["paged", "vmem"])
def test_the_pools_bytes_are_the_bytes_asked_for(cache):
    with Engine(model("tiny-gemma3"), cache=cache, cache_bytes=128 * KiB, max_context=256,
                self_check=False, **options_for(cache, page_bytes=4096)) as engine:
        engine.generate([list(range(1, 18))], SamplingParams(max_new_tokens=3, ignore_eos=True))
        stats, manager = engine.stats(), engine.kv.manager
        assert 127 * KiB < stats.cache_bytes <= 128 * KiB       # vmem: whole tokens of it
        assert manager.cache_bytes == 128 * KiB
