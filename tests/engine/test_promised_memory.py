"""Several engines in one process never promise more memory than the device has: a grow's pages
are created when first mapped, so the bytes a pool may use past ``committed_bytes`` are promised
but not out of the available memory yet; every other engine's check (construction, resize,
rebalance, wake) leaves them out. Two engines each grew to 17 GiB on a 23.5 GiB host, and two on
a 1 TiB budget to 21 GiB each. Available and total memory are faked (monkeypatch): the grown
pages are never mapped, so nothing here allocates more than a few hundred KiB."""
from __future__ import annotations

import gc

import pytest
import torch

from vmemkv.runtime import memory
from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams
from vmemkv.runtime.errors import CacheTooLargeError
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError

from .conftest import model

KiB = 1024
HOST = torch.device("cpu")
OPTS = dict(max_batch=4, max_context=512, page_bytes=4096, layout="per-layer",
            max_tokens_per_step=8, self_check=False)


@pytest.fixture
def host_of_1_mib(monkeypatch):
    """1 MiB available (it never moves: nothing grown is mapped), 8 MiB in all; no engine of an
    earlier test promising anything."""
    gc.collect()
    assert memory.promised_bytes(HOST) == 0, "an earlier test left a grown engine open"
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 1024 * KiB)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 8192 * KiB)


def _engine(**options) -> Engine:
    options = {"cache_bytes": 64 * KiB, "max_cache_bytes": 4096 * KiB, **options}
    return Engine(model(), **options, **OPTS)


def test_a_grow_past_what_another_engine_promised_is_refused_and_changes_nothing(host_of_1_mib):
    with _engine() as a, _engine() as b:
        assert a.resize_cache(576 * KiB) == 576 * KiB         # 512 KiB promised, 64 created
        assert a.promised_bytes(HOST) == 512 * KiB and a.committed_bytes == 64 * KiB
        # B alone saw 1 MiB: 580 KiB (516 past its 64 KiB) was accepted beside A's 512 promised
        with pytest.raises(CacheResizeError) as info:
            b.resize_cache(580 * KiB)
        for words in ("needs 528384 bytes", "MemAvailable (1048576 bytes) less the 524288 "
                      "bytes other KV pools in this process promised", "is 524288 bytes"):
            assert words in str(info.value), (words, str(info.value))
        assert (b.cache_bytes, b.committed_bytes, b.promised_bytes(HOST)) == (64 * KiB, 64 * KiB, 0)
        assert (a.cache_bytes, a.promised_bytes(HOST)) == (576 * KiB, 512 * KiB)
        assert b.resize_cache(576 * KiB) == 576 * KiB          # the 512 KiB left: fits exactly
        assert memory.promised_bytes(HOST) == 1024 * KiB       # all of it, never more
        # memory_utilization: that fraction of what A left (512 KiB) + what B created
        assert b.resize_cache(memory_utilization=0.5) == 64 * KiB + 512 * KiB // 2


def test_an_engine_built_beside_promises_counts_them(host_of_1_mib):
    with _engine() as a:
        a.resize_cache(1024 * KiB)                             # 960 KiB promised, 64 left
        with pytest.raises(CacheTooLargeError) as info:
            _engine(cache_bytes=128 * KiB)
        assert "less the 983040 bytes other KV pools in this process promised" in str(info.value)
        assert memory.promised_bytes(HOST) == 960 * KiB        # the refused one promised nothing


def test_closing_an_engine_returns_its_promise(host_of_1_mib):
    a, b = _engine(), _engine()
    try:
        a.resize_cache(1024 * KiB)
        with pytest.raises(CacheResizeError):
            b.resize_cache(132 * KiB)          # 68 KiB past what it created; 64 left
        a.close()
        assert a.promised_bytes(HOST) == 0 and memory.promised_bytes(HOST) == 0
        assert b.resize_cache(1024 * KiB) == 1024 * KiB
    finally:
        a.close()
        b.close()
    assert memory.promised_bytes(HOST) == 0


def test_rebalance_grows_only_into_what_no_other_engine_promised(host_of_1_mib):
    budget = MemoryBudget(4096 * KiB, idle_release_s=100.0)
    with _engine() as b, Engine(model(), memory_budget=budget, cache_bytes=64 * KiB,
                                **OPTS) as a:
        b.resize_cache(960 * KiB)                              # 896 KiB promised, 128 left
        for _ in range(2):          # 104 tokens each (512 bytes a token): one fits 64 KiB
            a.add_request([5] * 100, SamplingParams(max_new_tokens=4))
        sizes = []
        for _ in range(3):          # the 2nd grows by a step (1/8 of its 4 MiB max) unless capped
            a.step()
            sizes.append(a.cache_bytes)
        # its room: 64 created + the 128 KiB nobody promised (it grew to 576 KiB before)
        assert sizes == [64 * KiB, 192 * KiB, 192 * KiB]
        assert memory.promised_bytes(HOST) == 896 * KiB + 192 * KiB - a.committed_bytes
        assert memory.promised_bytes(HOST) + a.committed_bytes + b.committed_bytes <= 1024 * KiB + \
            128 * KiB        # promised + created: what both started with (64 each) + 1 MiB


def test_a_budget_larger_than_the_device_is_refused_naming_both(host_of_1_mib, monkeypatch):
    """A 1 TiB budget on a 23.5 GiB host was accepted, each engine's max its total: the first
    grow step (1/8 of it) asked for all the available memory. Refused before anything is
    built, as the docs have the budget: one device's memory."""
    from vmemkv.runtime.engine import engine as engine_module
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 2048 * KiB)
    budget = MemoryBudget(3072 * KiB)       # its page ids' tables: 768 KiB, within the 1 MiB
    built, real_make_kv = [], engine_module.make_kv
    monkeypatch.setattr(engine_module, "make_kv",
                        lambda *args, **kwargs: built.append(1) or real_make_kv(*args, **kwargs))
    with pytest.raises(EngineConfigError) as info:
        Engine(model(), memory_budget=budget, cache_bytes=64 * KiB, **OPTS)
    assert built == []                      # refused before any cache or page table is built
    for words in ("total_bytes (3145728)", "host MemTotal (2097152 bytes)"):
        assert words in str(info.value), (words, str(info.value))
    assert budget.held_bytes == 0 and budget.stats()["shares"] == {}
    assert memory.promised_bytes(HOST) == 0
    fits = MemoryBudget(2048 * KiB)
    with Engine(model(), memory_budget=fits, cache_bytes=64 * KiB, **OPTS) as engine:
        assert engine.memory_share.max_bytes == 2048 * KiB
