"""The memory a grow needs, checked before ``resize_cache`` or ``rebalance_memory`` commits
anything: the new size less the pool's ``committed_bytes`` (pages promised by an earlier grow
and never mapped are not in the available memory either: repeated
``resize_cache(memory_utilization=0.9)`` grew 61.5, 119, 176.5, ... MiB against a fixed 64 MiB),
and, with the cache on the host and spawned tensor-parallel ranks, once per rank (one rank's
growth was checked: 1 MiB then ``resize_cache(11 MiB)`` was accepted for two ranks against 12 MiB,
while construction at 7 MiB a rank was refused). Available memory is faked (monkeypatch); the
rank count is the engine's config, read by the checks only (no rank is spawned: 13 s here)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from vmemkv.runtime import memory
from vmemkv.runtime.engine import Engine
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError

from .conftest import model

KiB = 1024
OPTS = dict(max_batch=4, max_context=512, page_bytes=4096, layout="per-layer",
            max_tokens_per_step=8, self_check=False)


def _available(monkeypatch, num_bytes: int) -> None:
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: num_bytes)


def _as_spawned_ranks(engine, ranks: int) -> None:
    """The engine's checks now count ``ranks`` pools on this host, as spawned ranks' would be."""
    engine.config = replace(engine.config, tensor_parallel_size=ranks, tp_launch="spawn")


def test_memory_utilization_again_changes_nothing_and_unmapped_growth_counts(monkeypatch):
    _available(monkeypatch, 1024 * KiB)     # never moves: the grown pages are never mapped
    with Engine(model(), cache_bytes=64 * KiB, max_cache_bytes=4096 * KiB, **OPTS) as engine:
        pool = engine.kv.cache.pool
        assert pool.committed_bytes == 64 * KiB
        sizes = [engine.resize_cache(memory_utilization=0.5) for _ in range(4)]
        # 512 KiB of the 1 MiB available + the 64 KiB created; it was 576, 1088, 1600, 2112 KiB
        assert sizes == [576 * KiB] * 4
        assert pool.committed_bytes == 64 * KiB
        # 1092 KiB: 516 KiB more than now fits 1 MiB, but 1028 KiB past what exists does not
        with pytest.raises(CacheResizeError) as info:
            engine.resize_cache(1092 * KiB)
        for words in ("growing the KV cache by 528384 bytes", "1052672 of them beyond the 65536 "
                      "bytes whose pages exist", "needs 1052672 bytes",
                      "MemAvailable is 1048576 bytes", "grow less"):
            assert words in str(info.value), (words, str(info.value))
        assert "swap_bytes" not in str(info.value)       # no swap space: not the remedy
        assert engine.cache_bytes == 576 * KiB and engine.committed_bytes == 64 * KiB
        assert engine.resize_cache(1088 * KiB) == 1088 * KiB   # 64 + 1024: fits exactly


def test_a_grow_under_spawned_host_ranks_is_checked_once_per_rank(monkeypatch):
    _available(monkeypatch, 1024 * KiB)
    with Engine(model(), cache_bytes=64 * KiB, max_cache_bytes=4096 * KiB, **OPTS) as engine:
        _as_spawned_ranks(engine, 2)
        with pytest.raises(CacheResizeError) as info:   # 2 x 516 KiB > 1 MiB (516 passed)
            engine.resize_cache(580 * KiB)
        for words in ("growing the KV cache by 528384 bytes on each of 2 tensor-parallel ranks",
                      "needs 1056768 bytes", "MemAvailable is 1048576 bytes"):
            assert words in str(info.value), (words, str(info.value))
        assert engine.cache_bytes == 64 * KiB
        assert engine.resize_cache(576 * KiB) == 576 * KiB    # 2 x 512 KiB: fits exactly
        engine.resize_cache(64 * KiB)
        # per rank, as at construction: 2 x 0.9 of the host is refused, nothing changed
        with pytest.raises(CacheResizeError, match=r"memory_utilization=0.9 is per rank.*2 "
                                                   r"tensor-parallel ranks.*1\.80.*at most 1/2"):
            engine.resize_cache(memory_utilization=0.9)
        assert engine.cache_bytes == 64 * KiB
        assert engine.resize_cache(memory_utilization=0.25) == 320 * KiB   # 256 + 64 created
        assert engine.resize_cache(memory_utilization=0.25) == 320 * KiB   # again: the same
        _as_spawned_ranks(engine, 1)


def test_rebalance_grows_each_spawned_rank_by_its_share_of_what_is_not_promised(monkeypatch):
    _available(monkeypatch, 768 * KiB)
    budget = MemoryBudget(1 << 20)
    with Engine(model(), memory_budget=budget, cache_bytes=32 * KiB, **OPTS) as engine:
        _as_spawned_ranks(engine, 2)
        monkeypatch.setattr(engine.memory_share, "decide", lambda *a, **k: 640 * KiB)
        engine.rebalance_memory()
        # 32 KiB created + 768 KiB / 2 ranks; it grew to 640 KiB (2 x 608 KiB past 768)
        assert engine.cache_bytes == budget.held_bytes == 416 * KiB
        engine.rebalance_memory()      # the 384 KiB promised a rank are not created: no room
        assert engine.cache_bytes == budget.held_bytes == 416 * KiB   # it went to 640 KiB
        _as_spawned_ranks(engine, 1)
