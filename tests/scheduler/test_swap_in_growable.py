"""A growable pool (a MemoryBudget resizes it) whose swapped sequence fits it exactly but not
with its next token: swapped in, it was swapped out again at the next step, step after step
until the budget grew the pool (threaded engines on one budget counted up to 2,753 preemptions
for 8 requests, each a swap of the whole sequence out and back). It now waits swapped for the
pool to grow; a static pool, and a swapped sequence that does not fit an empty growable pool
at all, behave as before."""
import pytest

from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import PAGE, TINY

BPT = TINY.bytes_per_token


def _step(sched):
    sched.update({s.seq_id: 1 for s in sched.schedule().seqs if s.sample})


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_a_swapped_sequence_that_fits_only_without_its_next_token_waits_for_the_pool_to_grow(
        layout):
    mgr = make_manager("vmem", TINY, 256 * BPT, 256, page_bytes=PAGE, layout=layout,
                       swap_bytes=1024 * BPT, max_cache_bytes=256 * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=2, max_seq_len=256, preemption="swap"))
    sched.growable = True
    sched.resize(128 * BPT)
    cap = mgr.stats().total_tokens
    sched.add_request(Request(0, prompt_len=cap - 2, max_tokens=20))
    while not sched.swapped:                   # decodes until the pool is full: swapped out
        _step(sched)
    assert sched.metrics.num_preemptions == 1 and mgr.num_tokens(0) == cap
    for _ in range(20):                        # nothing grows the pool meanwhile
        _step(sched)
    assert sched.metrics.num_preemptions == 1 and len(sched.swapped) == 1
    sched.resize(256 * BPT)                    # the budget grows it: it swaps in and finishes
    while sched.has_unfinished():
        _step(sched)
    assert sched.metrics.num_preemptions == 1 and sched.metrics.generated_tokens == 20


def test_a_static_pool_swaps_in_as_before():
    """Not growable: the check with the next token does not apply (the pool never grows)."""
    mgr = make_manager("vmem", TINY, 128 * BPT, 256, page_bytes=PAGE, layout="per-layer",
                       swap_bytes=1024 * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=2, max_seq_len=128, preemption="swap"))
    for i in range(2):
        sched.add_request(Request(i, prompt_len=40, max_tokens=40))
    while sched.has_unfinished():
        _step(sched)
    assert sched.metrics.generated_tokens == 80
