"""Elastic KV memory in the engine (runtime/engine/elastic.py): resize under load, sleep and
wake, a MemoryBudget shared by two models. Tokens equal transformers' greedy through every
resize; nothing is dropped; a refused resize changes nothing; the memory given back is gone
from the memfd pool (its allocated blocks, as the kernel counts them) and from RSS."""
from __future__ import annotations

import os
import stat

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import (CacheShrunkRequestError, EngineClosedError,
                                          EngineConfigError, RequestRejectedError,
                                          EngineSleepingError)
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError

from .conftest import engine_state, hf_greedy, model, prompts, tokens

KiB = 1024
# tiny models: 2 layers x 2 kv heads x 16 dims fp32: a 4 KiB per-layer page holds 32 tokens,
# a group (8 member pages) 32 KiB; interleaved: 16 tokens a page, a group 4 KiB... x4
LAYOUTS = {"per-layer": dict(layout="per-layer", page_bytes=4 * KiB),
           "interleaved": dict(layout="interleaved", page_bytes=4 * KiB)}
SP = SamplingParams(max_new_tokens=24, ignore_eos=True)


def memfd_bytes() -> int:
    """Bytes the kernel has allocated to this process's vmemkv memfds (their st_blocks)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "vmemkv-pages" in os.readlink(f"/proc/self/fd/{fd}"):
                st = os.fstat(int(fd))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_blocks * 512
        except OSError:
            continue
    return total


def rss_shmem_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resize_under_load_keeps_every_request_token_identical(layout, preemption):
    batch = prompts(6, 8, 30, seed=5)
    swap = dict(swap_bytes=1 << 20) if preemption == "swap" else {}
    with Engine(model(), max_batch=4, max_context=64, cache_bytes=64 * KiB,
                max_cache_bytes=256 * KiB, preemption=preemption, check_integrity=True,
                **LAYOUTS[layout], **swap) as engine:
        ids = [engine.add_request(p, SP) for p in batch]
        sizes = [256 * KiB, 32 * KiB, 128 * KiB, 64 * KiB, 256 * KiB]
        for size in sizes:
            for _ in range(4):
                engine.step()
            assert engine.resize_cache(size, preempt=True) == size
            assert engine.kv.cache.pool.committed_bytes <= size
        engine.run_until_done()
        out = [engine.output(r, pop=True) for r in ids]
        assert engine.scheduler.metrics.num_preemptions > 0, "the 32 KiB shrink was meant to preempt"
        if preemption == "swap":
            assert engine.scheduler.metrics.num_swap_preemptions > 0
    assert tokens(out) == hf_greedy("tiny-llama", batch, 24, ignore_eos=True)


def test_a_refused_resize_changes_nothing_and_names_the_bytes():
    batch = prompts(4, 20, 30, seed=3)
    with Engine(model(), max_batch=4, max_context=64, cache_bytes=128 * KiB,
                max_cache_bytes=128 * KiB, **LAYOUTS["per-layer"]) as engine:
        for p in batch:
            engine.add_request(p, SP)
        engine.step()
        before = engine_state(engine)
        with pytest.raises(CacheResizeError, match=r"65536 bytes are held by 4 running .*"
                                                   r"preempt=True"):
            engine.resize_cache(0)
        with pytest.raises(CacheResizeError, match="exceeds max_cache_bytes=131072"):
            engine.resize_cache(256 * KiB)
        with pytest.raises(CacheResizeError, match="one of cache_bytes and memory_utilization"):
            engine.resize_cache()
        with pytest.raises(CacheResizeError, match="preempt must be True or False, got 'no'"):
            engine.resize_cache(0, preempt="no")          # was true: it preempted
        assert engine_state(engine) == before and engine.cache_bytes == 128 * KiB
        # a waiting request that would no longer fit refuses the shrink too
        engine.add_request(list(range(60)), SamplingParams(max_new_tokens=4))
        with pytest.raises(CacheResizeError, match="needs 64 tokens"):
            engine.resize_cache(16 * KiB, preempt=True)
    with Engine(model(), max_batch=4, max_context=64, cache="paged", block_size=4,
                cache_bytes=48 * KiB) as paged:
        with pytest.raises(CacheResizeError, match="needs cache='vmem'"):
            paged.resize_cache(32 * KiB)
    with pytest.raises(EngineConfigError, match="max_cache_bytes / min_cache_bytes need"):
        Engine(model(), cache="paged", max_cache_bytes=1 << 20)
    with pytest.raises(EngineConfigError, match=r"max_cache_bytes \(524288\) is below"):
        Engine(model(), cache_bytes=1 << 20, max_cache_bytes=1 << 19)


def test_sleep_gives_every_page_back_and_wake_serves_the_same_tokens():
    batch = prompts(4, 8, 30, seed=9)
    mib = 2**20
    with Engine(model(), max_batch=4, max_context=1024, cache_bytes=8 * mib,
                **LAYOUTS["per-layer"]) as engine:
        ids = [engine.add_request(p, SP) for p in batch]
        for _ in range(3):
            engine.step()
        held_fd, held_rss = memfd_bytes(), rss_shmem_bytes()
        assert held_fd >= engine.kv.cache.pool.committed_bytes >= 256 * KiB
        assert engine.sleep() == 8 * mib
        assert engine.is_sleeping and engine.cache_bytes == 0
        assert engine.kv.cache.pool.committed_bytes == 0
        freed_fd, freed_rss = held_fd - memfd_bytes(), held_rss - rss_shmem_bytes()
        assert freed_fd >= 8 * mib - 64 * KiB, (held_fd, freed_fd)   # the whole pool, measured
        assert freed_rss > 0, "RSS did not fall"
        late = engine.add_request(batch[0], SP)       # waits while asleep
        assert engine.step() == [] and engine.status(late) == "waiting"
        with pytest.raises(EngineSleepingError, match="wake"):
            engine.generate([batch[0]], SP)           # refused before queueing anything
        assert engine.scheduler.has_unfinished() and len(engine.scheduler.waiting) == 5
        assert engine.sleep() == 0                    # idempotent
        assert engine.wake() == 8 * mib and not engine.is_sleeping
        engine.run_until_done()
        out = [engine.output(r, pop=True) for r in ids + [late]]
    assert tokens(out) == hf_greedy("tiny-llama", batch + [batch[0]], 24, ignore_eos=True)
    for call in (engine.sleep, engine.wake):           # wake() answered a closed engine
        with pytest.raises(EngineClosedError):
            call()


def test_two_models_share_one_budget_and_the_idle_one_gives_pages_back():
    clock = [0.0]
    budget = MemoryBudget(512 * KiB, idle_release_s=1.0, clock=lambda: clock[0])
    opts = dict(max_batch=8, max_context=64, check_integrity=True, **LAYOUTS["per-layer"])
    a_batch, b_batch = prompts(8, 20, 30, seed=11), prompts(3, 8, 20, seed=12)
    with Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=128 * KiB,
                min_cache_bytes=64 * KiB, **opts) as a, \
            Engine(model("tiny-qwen2"), memory_budget=budget, cache_bytes=384 * KiB,
                   min_cache_bytes=64 * KiB, **opts) as b:
        assert budget.held_bytes == 512 * KiB
        with pytest.raises(EngineConfigError, match="do not fit the budget"):
            Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=64 * KiB, **opts)
        b_out = b.generate(b_batch, SP)
        clock[0] = 1.0
        b.step()                                      # B seen idle from here
        assert b.cache_bytes == 384 * KiB
        clock[0] = 2.5
        b.step()                                      # idle past idle_release_s: down to min
        assert b.cache_bytes == 64 * KiB and budget.held_bytes == 192 * KiB
        ids = [a.add_request(p, SP) for p in a_batch]
        peak = 0
        while a.has_unfinished():
            a.step()
            peak = max(peak, a.cache_bytes)
            assert budget.held_bytes == a.cache_bytes + b.cache_bytes <= budget.total_bytes
        a_out = [a.output(r, pop=True) for r in ids]
        assert peak > 128 * KiB, "A never grew into the pages B gave back"
        assert peak <= 512 * KiB - 64 * KiB           # B's minimum stays reserved
        stats = budget.stats()
        assert stats["shares"][b.memory_share.name].gives == 1
        assert stats["shares"][a.memory_share.name].grows >= 1
    assert budget.held_bytes == 0                     # closed engines leave the budget
    assert tokens(a_out) == hf_greedy("tiny-llama", a_batch, 24, ignore_eos=True)
    assert tokens(b_out) == hf_greedy("tiny-qwen2", b_batch, 24, ignore_eos=True)


def test_an_engine_given_back_to_nothing_while_idle_grows_again_for_the_next_request():
    clock = [0.0]
    budget = MemoryBudget(256 * KiB, idle_release_s=1.0, clock=lambda: clock[0])
    batch = prompts(3, 8, 30, seed=4)
    with Engine(model(), memory_budget=budget, cache_bytes=128 * KiB, min_cache_bytes=0,
                max_batch=4, max_context=64, check_integrity=True, **LAYOUTS["per-layer"]) as e:
        e.step()
        clock[0] = 2.0
        e.step()                                     # idle past idle_release_s: all given back
        assert e.cache_bytes == 0 and budget.held_bytes == 0
        out = e.generate(batch, SP)                  # admitted (the budget can grow it back)
        assert e.cache_bytes > 0
    assert tokens(out) == hf_greedy("tiny-llama", batch, 24, ignore_eos=True)


def test_a_request_that_fits_only_a_larger_cache_is_refused_as_shrunk_until_it_grows():
    # per-layer 4 KiB pages of 32 tokens, 4 members: 16 KiB holds 32 tokens of a sequence,
    # 32 KiB (the max) 64 (max_context); what fits at max_cache_bytes is not "can never fit"
    with Engine(model(), max_batch=2, max_context=64, cache_bytes=16 * KiB,
                max_cache_bytes=32 * KiB, **LAYOUTS["per-layer"]) as engine:
        assert engine.scheduler.max_fit_tokens == 32
        assert engine.scheduler.max_fit_tokens_at_max == 64
        before = engine_state(engine)
        long = list(range(1, 41))
        for submit in (lambda: engine.add_request(long, SP, index=2),
                       lambda: engine.generate([[1, 2], long], SP)):
            with pytest.raises(CacheShrunkRequestError, match=r"40 prompt \+ 24 new tokens = 64 "
                               r"tokens do not fit the cache at its current size \(16384 bytes, "
                               r"32 tokens .*resized back up it holds 64"):
                submit()
            assert engine_state(engine) == before
        with pytest.raises(RequestRejectedError, match="65 tokens exceed the 64 tokens") as never:
            engine.add_request(long + [7], SP)
        assert type(never.value) is RequestRejectedError
        engine.resize_cache(0)
        with pytest.raises(CacheShrunkRequestError, match=r"\(0 bytes, 0 tokens"):
            engine.add_request([1, 2], SamplingParams(max_new_tokens=2))
        engine.resize_cache(32 * KiB)
        assert tokens(engine.generate([long], SP)) == hf_greedy("tiny-llama", [long], 24,
                                                                   ignore_eos=True)
