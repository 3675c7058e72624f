"""Sizes between two pages: a vmem pool holds whole pages. An engine joining a MemoryBudget at
such a ``cache_bytes`` was counted in full by the budget until its first step, which then
booked the difference as a give that never happened; ``resize_cache`` of the configured
``max_cache_bytes`` was refused as past the pool's."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError

from .conftest import model


def test_a_share_holds_what_the_built_pool_holds_and_counts_no_give():
    budget = MemoryBudget(total_bytes=1 << 20, idle_release_s=100.0)
    with Engine(model(), memory_budget=budget, cache_bytes=100_000, page_bytes=4096,
                max_context=256) as engine:
        assert engine.cache_bytes == 98_304      # 6 page groups of 16 KiB (4 pages of 4 KiB)
        stats = budget.stats()
        assert stats["held_bytes"] == engine.cache_bytes
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        share = budget.stats()["shares"][engine.memory_share.name]
        assert (share.held_bytes, share.gives, share.given_bytes) == (98_304, 0, 0)


def test_resize_to_the_configured_max_between_two_pages_gives_the_whole_pages_below_it():
    # EngineConfig.max_cache_bytes=300000: the pool's page ids cover 294912 bytes (18 groups of
    # 16 KiB); resize_cache(300000) was refused as "exceeds max_cache_bytes=294912"
    with Engine(model(), cache_bytes=64 * 1024, max_cache_bytes=300_000, page_bytes=4096,
                max_context=256) as engine:
        assert engine.resize_cache(300_000) == 294_912 == engine.cache_bytes
        with pytest.raises(CacheResizeError, match=r"cache_bytes=311296 \(311296 in whole "
                                                   r"page groups\) exceeds max_cache_bytes=294912"):
            engine.resize_cache(294_912 + 16 * 1024)
        assert engine.cache_bytes == 294_912


def test_a_share_whose_minimum_is_between_two_page_groups_claims_only_what_it_holds():
    # min_cache_bytes defaults to cache_bytes: 100000 claimed 1696 bytes the pool never held
    budget = MemoryBudget(total_bytes=1 << 20, idle_release_s=100.0)
    with Engine(model(), memory_budget=budget, cache_bytes=100_000, page_bytes=4096,
                max_context=256) as engine:
        share = budget.stats()["shares"][engine.memory_share.name]
        assert share.min_bytes == share.held_bytes == 98_304
        assert budget.stats()["unclaimed_bytes"] == (1 << 20) - 98_304
