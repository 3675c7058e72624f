"""A MemoryBudget's grants are whole resize steps of the pool they grow."""
import pytest

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import TINY, manager
from .test_adapter_elastic import resize, run_with_budget

BPT = TINY.bytes_per_token


@pytest.mark.parametrize("layout, step_tokens", [("per-layer", 8), ("interleaved", 2)])
def test_a_grow_step_below_the_pools_own_still_grows_it(layout, step_tokens):
    """A budget whose grow step (``grow_fraction`` of the max, 1 token here) is below the
    pool's resize step (a slice of every member: 8 tokens per-layer) granted less than one:
    the pool rounded it down to no growth, and the request waited for ever (seen as an
    engine's 4-beam group stuck at 64 KiB of a 96 KiB max for 500 steps). Now a grant is
    rounded up to whole steps."""
    now = [0.0]
    budget = MemoryBudget(1024 * BPT, idle_release_s=1.0, grow_fraction=0.001,
                          clock=lambda: now[0])
    mgr = manager("vmem", layout, tokens=64, max_cache_bytes=256 * BPT)
    assert mgr.resize_step_bytes == step_tokens * BPT
    share = budget.register("lane", 32 * BPT, 256 * BPT, 64 * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    sched.growable = True
    assert share.decide(sched) is None
    now[0] = 2.0                                   # idle: shrunk to its minimum
    resize(sched, share, share.decide(sched))
    assert mgr.cache_bytes == 32 * BPT
    sched.add_request(Request(0, prompt_len=35, max_tokens=4))    # K/V of 38 tokens at most
    run_with_budget(sched, share)
    assert sched.seqs[0].state is SeqState.FINISHED
    assert mgr.cache_bytes % mgr.resize_step_bytes == 0 and mgr.cache_bytes >= 38 * BPT
    assert share.held_bytes == mgr.cache_bytes
