"""A MemoryBudget's grants are whole resize steps of the pool they grow."""
import pytest

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.budget_needs import growth_bytes, unused_bytes, wanted_bytes
from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import TINY, manager, ref
from .test_adapter_elastic import resize, run_with_budget, shrunk_growable

BPT = TINY.bytes_per_token
KIB = 1024


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


def _hybrid_chunking_after_recompute():
    """One full and one windowed layer (window 8, 4 tokens a 1 KiB page), a 32 KiB pool: 32
    tokens whole, 52 behind the window. A 52-token request preempted by recompute at 41 tokens
    comes back with its prompt and grows chunk by chunk; then a budget's partial shrink leaves
    the pool at what it holds (12 of 41 tokens computed), so its next chunk gets no room."""
    model = ModelSpec("w", 2, 4, 32, 2, weight_bytes=0, layer_windows=(8, None))
    mgr = make_manager("vmem", model, 32 * KIB, 512, page_bytes=KIB, layout="per-layer",
                       hybrid_parts=True, max_cache_bytes=32 * KIB)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=512, max_tokens_per_step=4,
                                           preemption="recompute", check_every_step=True))
    sched.add_request(Request(0, prompt_len=4, max_tokens=48))
    seq = sched.seqs[0]
    while seq.length <= 40:
        _step(sched)
    _in_transaction(sched, lambda: sched.resize(4 * KIB, preempt=True, check_fit=False))
    _in_transaction(sched, lambda: sched.resize(32 * KIB))
    for _ in range(3):
        _step(sched)
    _in_transaction(sched, lambda: sched.resize(4 * KIB, partial=True))
    assert (seq.state, seq.num_computed, mgr.cache_bytes) == (SeqState.RUNNING, 12, 12 * KIB)
    return sched, seq


def test_a_running_chunk_that_gets_no_room_asks_the_budget_to_grow():
    # the chunk got no room, nothing was preempted or waiting: the budget saw no need and the
    # sequence stayed running at 12 of 41 tokens for ever (two tiny-gemma3 engines on one
    # budget: 2,000 rounds, 56 KiB of the budget unclaimed); now the step is starved
    sched, seq = _hybrid_chunking_after_recompute()
    budget = MemoryBudget(32 * KIB, idle_release_s=1.0, clock=lambda: 0.0)
    share = budget.register("a", 4 * KIB, 32 * KIB, 12 * KIB)
    sched.growable = True
    steps = run_with_budget(sched, share)
    assert seq.state is SeqState.FINISHED and seq.length == 52 and steps < 100


def test_a_running_chunk_that_can_never_get_room_fails_by_name():
    # a pool that cannot grow: nothing would change step after step; the request fails
    sched, seq = _hybrid_chunking_after_recompute()
    with pytest.raises(RequestTooLargeError, match=r"sequence 0 \(41 tokens\) gets no room to "
                                                   r"grow in a cache") as error:
        sched.schedule()
    assert error.value.request_id == 0


def _step(sched) -> None:
    plan = sched.schedule()
    sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})


def _in_transaction(sched, action) -> None:
    sched.begin()
    sched.manager.begin()
    action()
    sched.manager.commit()
    sched.commit()


def test_the_budget_asks_for_what_admission_allocates_a_recomputed_windowed_sequence():
    # preempted by recompute at 41 tokens, past the 32 the pool holds whole: admission
    # allocates its 4-token prompt and grows it chunk by chunk; the budget asked for all 41
    # (41 KiB, past the 32 KiB the share may reach), taking memory from other shares for
    # nothing
    model = ModelSpec("w", 2, 4, 32, 2, weight_bytes=0, layer_windows=(8, None))
    mgr = make_manager("vmem", model, 32 * KIB, 512, page_bytes=KIB, layout="per-layer",
                       hybrid_parts=True, max_cache_bytes=32 * KIB)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=512, max_tokens_per_step=4,
                                           preemption="recompute"))
    sched.add_request(Request(0, prompt_len=4, max_tokens=48))
    seq = sched.seqs[0]
    while seq.length <= 40:
        _step(sched)
    _in_transaction(sched, lambda: sched.resize(4 * KIB, preempt=True, check_fit=False))
    assert seq.state is SeqState.WAITING and seq.length == 41 and sched._admit_tokens(seq) == 4
    held = mgr.cache_bytes
    assert wanted_bytes(sched, held, grow_step_bytes=0, preempted=False) <= held + 4 * KIB


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_one_grow_asks_for_the_head_requests_tokens_decode_room_and_adapter_at_once(layout):
    """The need is what the head lacks: its 40 tokens with its 8 to decode, and its adapter's
    48 tokens of pages, not resident (budget.py); a grow for the tokens alone left the adapter
    to later steps' grow fractions."""
    sched, share = shrunk_growable(layout)             # 16 tokens held, all free
    sched.add_request(Request(0, prompt_len=40, max_tokens=8, adapter=ref("big", "b", 48 * BPT)))
    assert share.decide(sched) >= (40 + 8 + 48) * BPT


def test_what_running_sequences_will_grow_into_counts_whole_pages():
    """growth_bytes: to its final 20 tokens a sequence of 8 (one whole page of 8 tokens) still
    needs 2 pages (16 tokens), its last page's tokens held already."""
    mgr = manager("vmem", "per-layer", tokens=128)
    assert mgr.tokens_per_page == 8
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    sched.add_request(Request(0, prompt_len=8, max_tokens=12))       # 20 tokens at most: 3 pages
    sched.add_request(Request(1, prompt_len=9, max_tokens=6))        # 15 at most: its 2 pages
    _step(sched)
    assert [mgr.num_tokens(q.seq_id) for q in sched.running] == [8, 9]
    assert growth_bytes(sched) == 16 * BPT


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_pages_a_finished_request_left_mapped_count_as_unused(layout):
    """unused_bytes: what no running sequence holds, the unused pages still mapped (counted
    allocated by stats(), reclaimable) included: with nothing running, the whole cache."""
    mgr = manager("vmem", layout, tokens=128)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    sched.add_request(Request(0, prompt_len=20, max_tokens=3))
    while sched.has_unfinished():
        _step(sched)
    assert mgr.reclaimable_tokens > 0
    assert unused_bytes(sched) == mgr.cache_bytes == 128 * BPT


def test_a_share_whose_last_step_preempted_asks_to_grow_with_nothing_waiting():
    """decide(preempted=True): running sequences were short of memory, so the share grows (a
    grow fraction) though no request waits and the head fits."""
    sched, share = shrunk_growable("per-layer")        # 16 tokens held of 256
    sched.add_request(Request(0, prompt_len=4, max_tokens=2))
    _step(sched)
    assert not sched.waiting and share.decide(sched) is None
    assert share.decide(sched, preempted=True) > share.held_bytes
