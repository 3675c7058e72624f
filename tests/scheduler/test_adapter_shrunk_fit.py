"""A request with a LoRA adapter on a pool resized below its max, or asleep, is refused as a
request without one is: 'can never fit' only where it fits no size up to ``max_cache_bytes``;
CacheShrunkError where it fits only resized back up; asleep, the pool is counted at the size it
wakes to. It had been checked at the pool as it is (asleep: 0 bytes), so every such request was
'can never fit' (RequestTooLargeError, not CacheShrunkError: no 503 with Retry-After)."""
import pytest

from vmemkv.scheduler.errors import CacheShrunkError, RequestTooLargeError
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import TINY, manager, ref

BPT = TINY.bytes_per_token    # bytes per token
BIG = ref("big", "big-1", 48 * BPT)        # 48 tokens' worth of pool pages
HUGE = ref("huge", "huge-1", 232 * BPT)    # beside it at 256 tokens: 24, never 48


def scheduler(built_tokens: int, now_tokens: int, max_tokens: int = 256) -> Scheduler:
    """A vmem scheduler built at ``built_tokens``, resized (as ``Engine.resize_cache``; 0:
    asleep, as ``Engine.sleep``) to ``now_tokens``."""
    mgr = manager("vmem", "per-layer", tokens=built_tokens, max_cache_bytes=max_tokens * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    sched.begin()
    mgr.begin()
    sched.resize(now_tokens * BPT, preempt=True, check_fit=bool(now_tokens))
    mgr.commit()
    sched.commit()
    assert mgr.cache_bytes == now_tokens * BPT
    return sched


def refusal(sched, adapter, kind=RequestTooLargeError) -> str:
    with pytest.raises(kind) as refused:
        sched.add_request(Request(0, prompt_len=40, max_tokens=8, adapter=adapter))
    assert not sched.has_unfinished() and not sched._unfinished_samples   # nothing queued
    return str(refused.value)


def test_shrunk_a_request_that_fits_beside_its_adapter_only_resized_up_is_cache_shrunk():
    sched = scheduler(128, 64)     # 48 tokens fit alone, 16 beside the adapter
    error = refusal(sched, BIG, CacheShrunkError)
    assert error == ("request 0: 48 tokens beside adapter 'big' (" + BIG.digest[:12] +
                     f", {48 * BPT} bytes) do not fit the cache at its current size "
                     f"({64 * BPT} bytes, 16 tokens of one sequence beside it); resized back up "
                     "it holds 64")
    error = refusal(sched, HUGE)
    assert not isinstance(error, CacheShrunkError)
    assert "48 tokens beside adapter 'huge'" in error and "can never fit; the cache holds 24 " \
        f"tokens of one sequence beside it resized up to {256 * BPT} bytes" in error


def test_asleep_a_request_is_checked_beside_its_adapter_at_the_size_it_wakes_to():
    sched = scheduler(128, 0)
    sched.add_request(Request(0, prompt_len=40, max_tokens=8, adapter=BIG))   # 64 at 128
    assert [s.seq_id for s in sched.waiting] == [0]
    sched = scheduler(128, 0, max_tokens=128)
    error = refusal(sched, ref("wide", "wide-1", 100 * BPT))      # 24 tokens beside it at 128
    assert "can never fit; the cache holds 24 tokens of one sequence beside it" in error


def test_asleep_after_a_shrink_one_that_fits_only_at_the_max_is_cache_shrunk():
    sched = scheduler(256, 64)
    sched.begin()
    sched.manager.begin()
    sched.resize(0, preempt=True, check_fit=False)       # asleep: it wakes to 64 tokens
    sched.manager.commit()
    sched.commit()
    error = refusal(sched, BIG, CacheShrunkError)
    assert f"({64 * BPT} bytes, the size it wakes to, 16 tokens of one sequence beside it); " \
        "resized back up it holds 64" in error
