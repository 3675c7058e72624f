"""LoRA adapters in a pool that resizes (issues 31 and 32): an adapter's pages come from the KV
pool, so a MemoryBudget grows the pool for a waiting request's adapter too, a request is
checked beside its adapter at the pool grown to its reach (it grows to that on demand), and a resize
that would leave a live request no room beside its adapter is refused.

On main before this, the budget asked only for the head request's KV: a pool shrunk while idle
grew back for the tokens and stopped there, and the request waited for its adapter's pages for
ever (nothing else running, so nothing ever freed them)."""
import pytest

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError, RequestTooLargeError
from vmemkv.scheduler.managers.base import LoadAdapter
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import TINY, check_pins, manager, ref

BPT = TINY.bytes_per_token    # bytes per token


def shrunk_growable(layout: str, held_tokens: int = 128, now_tokens: int = 16):
    """A vmem scheduler on a MemoryBudget share that held ``held_tokens`` and was shrunk to
    ``now_tokens`` (as an idle share is), as the engine and the simulator run one."""
    mgr = manager("vmem", layout, tokens=held_tokens, max_cache_bytes=256 * BPT)
    budget = MemoryBudget(256 * BPT, idle_release_s=1.0, clock=lambda: 0.0)
    share = budget.register("a", 16 * BPT, 256 * BPT, held_tokens * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    sched.growable = True
    resize(sched, share, now_tokens * BPT)
    assert mgr.cache_bytes == now_tokens * BPT and sched.max_fit_bytes == held_tokens * BPT
    return sched, share


def resize(sched, share, cache_bytes: int) -> None:
    """One budget resize as the engine does it: partial, in a transaction."""
    sched.begin()
    sched.manager.begin()
    sched.resize(cache_bytes, partial=True)
    sched.manager.commit()
    sched.commit()
    share.settle(sched.manager.cache_bytes)


def run_with_budget(sched, share, max_steps: int = 200) -> int:
    """Steps (the budget decides before each) until nothing is unfinished; their count."""
    for step in range(max_steps):
        if not sched.has_unfinished():
            return step
        target = share.decide(sched)
        if target is not None and target != sched.manager.cache_bytes:
            resize(sched, share, min(target, sched.manager.max_cache_bytes))
        plan = sched.schedule()
        check_pins(sched)
        sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})
    raise AssertionError(f"not finished after {max_steps} steps: waiting "
                         f"{[s.seq_id for s in sched.waiting]}, cache "
                         f"{sched.manager.cache_bytes // BPT} tokens")


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_the_budget_grows_the_pool_for_a_waiting_requests_adapter(layout):
    sched, share = shrunk_growable(layout)
    adapter = ref("big", "big-1", 48 * BPT)       # 48 tokens' worth of pool pages
    sched.add_request(Request(0, prompt_len=40, max_tokens=8, adapter=adapter))
    run_with_budget(sched, share)
    mgr = sched.manager
    assert sched.seqs[0].state is SeqState.FINISHED
    assert mgr.cache_bytes >= (48 + 48) * BPT      # its tokens and its adapter, at once
    assert mgr.adapter_stats().loads == 1 and mgr.adapter_uses(adapter) == 0
    mgr.check_integrity()


def test_a_request_is_checked_beside_its_adapter_at_the_pools_reach():
    sched, _ = shrunk_growable("per-layer")
    adapter = ref("big", "big-1", 48 * BPT)
    # 48 tokens beside 48 of adapter: no room in the 16 tokens held now, room in the pool grown
    # to its reach (here its max: no budget's other shares), to which it grows on demand
    assert sched.manager.max_sequence_tokens_with_adapter(adapter) == 0
    assert sched.manager.max_sequence_tokens_with_adapter(adapter, 128 * BPT) == 64
    sched.add_request(Request(0, prompt_len=40, max_tokens=8, adapter=adapter))
    vast = ref("vast", "vast-1", 220 * BPT)   # 32 tokens beside it at the 256-token max: never 48
    with pytest.raises(RequestTooLargeError, match=r"adapter 'vast'.*can never fit; the cache "
                       r"holds 32 tokens of one sequence beside it at its max \(1048576 bytes\)"):
        sched.add_request(Request(1, prompt_len=40, max_tokens=8, adapter=vast))
    assert [s.seq_id for s in sched.waiting] == [0] and 1 not in sched._unfinished_samples


def test_a_resize_that_leaves_a_request_no_room_beside_its_adapter_is_refused():
    mgr = manager("vmem", "per-layer", tokens=128, max_cache_bytes=256 * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    adapter = ref("big", "big-1", 48 * BPT)
    sched.add_request(Request(0, prompt_len=40, max_tokens=8, adapter=adapter))
    sched.begin()
    mgr.begin()
    with pytest.raises(CacheResizeError, match=r"resizing the cache to 262144 bytes: request 0: "
                                               r"48 tokens beside adapter 'big'"):
        sched.resize(64 * BPT)           # 64 tokens hold the request alone, not its adapter too
    mgr.rollback()
    sched.rollback()
    assert mgr.cache_bytes == 128 * BPT and sched.max_fit_tokens == 64
    sched.resize(96 * BPT)               # 48 beside 48: room for both
    plan = sched.schedule()
    assert [type(op) for op in plan.ops].count(LoadAdapter) == 1 and plan.seqs[0].seq_id == 0
