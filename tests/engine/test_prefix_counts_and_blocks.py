"""vmem's prefix cache finds hits in blocks of block_size: a block_size that does not divide a
vmem page's tokens, which left only whole pages findable silently, is refused naming both; and
``prefix_cache_cached_tokens`` counts what each layout's memory holds: a vmem block hit's copy
in both page groups that hold it, paged's shared block once (docs/usage.md)."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams

from .conftest import model

FIRST = list(range(1, 41))                       # 40 tokens: 10 blocks of 4
SECOND = FIRST[:20] + list(range(100, 110))      # shares 5 blocks with FIRST, then 10 of its own
ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)
CACHES = {"paged": dict(cache="paged"), "vmem-per-layer": dict(cache="vmem", layout="per-layer"),
          "vmem-interleaved": dict(cache="vmem", layout="interleaved")}


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_cached_tokens_count_a_vmem_block_copy_in_each_page_holding_it(cache):
    with Engine(model(), block_size=4, max_batch=2, max_context=128, prefix_sharing=True,
                check_integrity=True, self_check=False, **CACHES[cache]) as engine:
        engine.generate([FIRST], ONE)
        after_first = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        engine.generate([SECOND], ONE)
        hits = engine.last_stats.prefix_cache_hits
        after_second = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        engine.generate([SECOND[:28] + [7]], ONE)          # SECOND's 7 computed blocks
        again = engine.last_stats.prefix_cache_hits
    # FIRST's 10 blocks, then SECOND's 2 full blocks past the 5 it shares (paged: shared, 48);
    # vmem's second page holds the 5 copied blocks too (68)
    held = 48 if cache == "paged" else 68
    assert (after_first, hits, after_second, again) == (40, 20, held, 28)


@pytest.mark.parametrize("block_size", [5, 6])
def test_a_block_size_that_does_not_divide_a_vmem_page_is_refused_with_prefix_sharing(block_size):
    with pytest.raises(EngineConfigError, match=rf"EngineConfig.block_size {block_size} does not "
                                                rf"divide a vmem page's 512 tokens .*\(e.g. 4\)"):
        Engine(model(), cache="vmem", layout="per-layer", block_size=block_size, max_batch=2,
               max_context=128, prefix_sharing=True, self_check=False)


def test_a_dividing_block_size_finds_block_hits_and_without_sharing_none_is_asked():
    prompt, params = FIRST + [50], SamplingParams(max_new_tokens=2, ignore_eos=True)
    with Engine(model(), cache="vmem", layout="per-layer", block_size=4, max_batch=2,
                max_context=128, prefix_sharing=True, self_check=False) as engine:
        engine.generate([prompt], params)
        engine.generate([FIRST + [60]], params)
        assert engine.last_stats.prefix_cache_hits == 40
    with Engine(model(), cache="vmem", layout="per-layer", block_size=5, max_batch=2,
                max_context=128, self_check=False) as engine:    # no hits asked: nothing lost
        engine.generate([prompt], params)
        assert (engine.kv.manager.tokens_per_page, engine.last_stats.prefix_cache_hits) == (512, 0)


@pytest.mark.parametrize("name, layout, refused", [
    ("tiny-gemma3", "interleaved", True),         # full layers in every page: block hits
    ("tiny-gemma3", "per-layer", False),          # its windowed kind: whole page groups only
    ("tiny-mistral-swa", "interleaved", False),   # every layer windowed: whole groups only
])
def test_behind_a_window_no_block_is_asked_for_so_no_block_size_is_refused(name, layout, refused):
    options = dict(cache="vmem", layout=layout, block_size=5, max_batch=2, max_context=128,
                   prefix_sharing=True, self_check=False)
    if refused:
        with pytest.raises(EngineConfigError, match="block_size 5 does not divide a vmem page's "
                                                    "256 tokens"):
            Engine(model(name), **options)
        return
    with Engine(model(name), **options) as engine:
        assert engine.kv.manager.block_tokens == 0
