"""The longest sequence a windowed or hybrid model's pool holds: submission counts, per layer
kind, what the kind holds at each length (the units its window still reads and the newest),
not the whole length in every layer. Every request that bound admits runs to completion alone,
and beside others preempted by recompute; one past it is refused by name."""
import hashlib
import random

import pytest
from hypothesis import assume, given, settings, strategies as st

from vmemkv.scheduler.adapters import AdapterRef
from vmemkv.scheduler.errors import ConfigError, RequestTooLargeError
from vmemkv.scheduler.lifecycle import withdraw_request
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

MAX_LEN = 512
LAYOUTS = [("paged", "per-layer"), ("vmem", "per-layer"), ("vmem", "interleaved")]


def spec(window: int, full_layers: int, windowed_layers: int) -> ModelSpec:
    windows = (window,) * windowed_layers + (None,) * full_layers
    return ModelSpec("w", len(windows), 1, 4, 2, weight_bytes=0, layer_windows=windows)


def scheduler(model, policy, layout, cache_bytes, unit_bytes, **config):
    mgr = make_manager(policy, model, cache_bytes, MAX_LEN, block_size_tokens=unit_bytes // 16,
                       page_bytes=unit_bytes, layout=layout, hybrid_parts=True)
    config.setdefault("check_every_step", True)
    return Scheduler(mgr, SchedulerConfig(**config))


def run(sched, requests, rng, max_steps=20_000):
    """Submit ``requests`` (each checked alone first) and step until every one ends."""
    for request in requests:
        sched.add_request(request)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        plan = sched.schedule()
        sched.update({s.seq_id: rng.randrange(50) for s in plan.seqs if s.sample})
    raise AssertionError(f"not finished after {max_steps} steps: {sched.gauges()}")


def tiny_gemma3_like(policy, layout, cache_kib=128):
    """tiny-gemma3's KV shape (6 layers, 5 of them windowed, window 32), 4 KiB units."""
    model = ModelSpec("g3", 6, 2, 16, 4, weight_bytes=0, layer_windows=(32,) * 5 + (None,))
    mgr = make_manager(policy, model, cache_kib * 1024, 256, block_size_tokens=16,
                       page_bytes=4096, layout=layout, hybrid_parts=True)
    return Scheduler(mgr, SchedulerConfig(check_every_step=True))


@pytest.mark.parametrize("policy,layout,old,new", [("vmem", "per-layer", 64, 192),
                                                   ("paged", "per-layer", 80, 256),
                                                   ("vmem", "interleaved", 85, 85)])
def test_a_hybrids_bound_counts_what_each_kind_holds(policy, layout, old, new):
    # the full-length figure stays; a 20-token prompt may grow to what the kinds really hold
    # (interleaved keeps every layer of a page: nothing goes back, the bound is the same)
    sched = tiny_gemma3_like(policy, layout)
    assert sched.max_fit_tokens == old
    assert sched.fit_tokens(20) == (new, new)
    run(sched, [Request(0, 20, new - 20)], random.Random(0))
    assert sched.metrics.num_finished_requests == 1


@pytest.mark.parametrize("policy,layout", [("vmem", "per-layer"), ("paged", "per-layer"),
                                           ("vmem", "interleaved")])
def test_a_request_past_the_bound_is_refused_by_name(policy, layout):
    sched = tiny_gemma3_like(policy, layout)
    fit = sched.fit_tokens(20)[0]
    if fit < 256:
        with pytest.raises(RequestTooLargeError, match=rf"request 7: 20 prompt \+ {fit - 19} new"
                           rf" tokens = {fit + 1} tokens can never fit; the cache holds {fit}"):
            sched.add_request(Request(7, 20, fit - 19))
    with pytest.raises(RequestTooLargeError, match="request 8: 100 prompt"):
        sched.add_request(Request(8, 100, 10))     # a prompt is written whole: past 64 / 80 / 85


def test_the_never_fits_message_quotes_tokens_of_one_sequence():
    # a paged hybrid's stats count tokens of one block group (six groups of one layer here:
    # 32 blocks, 512 tokens), _never_fits quotes the tokens one sequence holds whole
    sched = tiny_gemma3_like("paged", "per-layer")
    assert sched.manager.stats().total_tokens == 512
    assert sched.manager.pool_sequence_tokens == 80 == sched.max_fit_tokens


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), window=st.integers(2, 40),
       kinds=st.sampled_from([(0, 1), (0, 2), (1, 1), (1, 3), (2, 2)]),
       unit_kib=st.sampled_from([1, 2]), units=st.integers(8, 40),
       prompt=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_every_request_the_bound_admits_runs_alone(layout, window, kinds, unit_kib, units,
                                                  prompt, seed):
    """For random windows, pools and prompts: the longest request submission admits runs to
    the end alone, and one token more is refused."""
    model = spec(window, *kinds)
    policy, lay = layout
    unit = unit_kib * 1024
    try:
        sched = scheduler(model, policy, lay, units * unit, unit, max_tokens_per_step=64,
                          max_running=4)
    except ConfigError:               # a pool too small for one page slice, say
        assume(False)
    fit = sched.fit_tokens(prompt)[0]
    assert fit >= min(sched.max_fit_tokens, MAX_LEN)
    if fit <= prompt:
        with pytest.raises(RequestTooLargeError):
            sched.add_request(Request(0, prompt, 1))
        return
    run(sched, [Request(0, prompt, fit - prompt)], random.Random(seed))
    assert [s.state for s in sched.seqs.values()] == [SeqState.FINISHED]
    if fit < MAX_LEN:
        with pytest.raises(RequestTooLargeError):
            sched.add_request(Request(1, prompt, fit - prompt + 1))


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), window=st.integers(2, 24),
       kinds=st.sampled_from([(0, 1), (1, 1), (1, 3)]), units=st.integers(10, 30),
       seed=st.integers(0, 2**16), chunk=st.sampled_from([4, 16, 256]))
def test_requests_the_bound_admits_finish_beside_others_by_recompute(layout, window, kinds,
                                                                   units, seed, chunk):
    """Several requests, each admitted alone, share the pool: a long one preempted by
    recompute comes back with its prompt allocated and grows chunk by chunk (never at its
    whole length), so every one finishes."""
    model, (policy, lay), rng = spec(window, *kinds), layout, random.Random(seed)
    try:
        sched = scheduler(model, policy, lay, units * 1024, 1024, max_tokens_per_step=chunk,
                          max_running=4, preemption="recompute")
    except ConfigError:
        assume(False)
    requests = []
    for i in range(4):
        prompt = rng.randint(1, 30)
        fit = sched.fit_tokens(prompt)[0]
        if fit > prompt:
            requests.append(Request(i, prompt, rng.randint(1, fit - prompt)))
    run(sched, requests, rng)
    assert sched.metrics.num_finished_requests == len(requests)


@pytest.mark.parametrize("window,blocks,chunk,requests,old,longest", [
    (37, 24, 64, [(2, 488), (13, 433), (4, 357)], 384, 396),
    # a chunk of 256 could never get room: shortened, it ends where a decode would hold as much
    (3, 15, 256, [(14, 376), (23, 420), (15, 357)], 192, 193)])
def test_a_sequence_preempted_past_the_whole_length_bound_comes_back(window, blocks, chunk,
                                                                    requests, old, longest):
    # one full layer beside three windowed ones, blocks of 64 tokens: a sequence preempted
    # past what the pool holds whole could never be allocated whole again: it comes back with
    # its prompt and grows chunk by chunk, each chunk holding what a decode at its end would
    sched = scheduler(spec(window, 1, 3), "paged", "per-layer", blocks * 1024, 1024,
                      max_running=3, max_tokens_per_step=chunk, preemption="recompute")
    for i, (prompt, new) in enumerate(requests):
        sched.add_request(Request(i, prompt, new))
    rng, most = random.Random(0), 0
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        most = max([most] + [sched.seqs[i].length for i in plan.preempted])
        sched.update({s.seq_id: rng.randrange(50) for s in plan.seqs if s.sample})
    assert sched.max_fit_tokens == old and most == longest
    assert sched.metrics.num_finished_requests == 3


def adapter(pages: int, unit_bytes: int = 4096) -> AdapterRef:
    return AdapterRef("a", hashlib.sha256(b"a").hexdigest(), pages * unit_bytes)


@pytest.mark.parametrize("policy,layout,whole,longest", [("vmem", "per-layer", 64, 128),
                                                         ("paged", "per-layer", 64, 224),
                                                         ("vmem", "interleaved", 74, 74)])
def test_beside_an_adapter_the_bound_counts_what_each_kind_holds(policy, layout, whole, longest):
    # an adapter of 3 units takes them from the pool KV holds: the bound beside it is what
    # the units left hold of a windowed sequence, not of its whole length in every layer
    sched, ref = tiny_gemma3_like(policy, layout), adapter(3)
    assert sched.manager.max_sequence_tokens_with_adapter(ref) == whole
    sched.add_request(Request(0, 20, longest - 20, adapter=ref))
    run(sched, [], random.Random(0))
    assert [s.length for s in sched.seqs.values()] == [longest]
    assert sched.metrics.num_finished_requests == 1
    with pytest.raises(RequestTooLargeError, match=rf"{longest + 1} tokens beside adapter 'a'"):
        sched.add_request(Request(1, 20, longest - 19, adapter=ref))


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), window=st.integers(2, 40),
       kinds=st.sampled_from([(0, 1), (1, 1), (1, 3)]), units=st.integers(8, 40),
       adapter_units=st.integers(1, 6), prompt=st.integers(1, 60), seed=st.integers(0, 2**16))
def test_every_adapter_request_the_bound_admits_runs_alone(layout, window, kinds, units,
                                                          adapter_units, prompt, seed):
    (policy, lay), unit = layout, 1024
    try:
        sched = scheduler(spec(window, *kinds), policy, lay, units * unit, unit,
                          max_tokens_per_step=64, max_running=4)
    except ConfigError:
        assume(False)
    ref = adapter(adapter_units, unit)
    fits = [final for final in (prompt + 1, MAX_LEN) if _admits(sched, prompt, final, ref)]
    assume(fits)
    low, high = prompt + 1, MAX_LEN       # the longest admitted (admission grows with length)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if _admits(sched, prompt, mid, ref) else (low, mid - 1)
    sched.add_request(Request(0, prompt, low - prompt, adapter=ref))
    run(sched, [], random.Random(seed))
    assert [s.state for s in sched.seqs.values()] == [SeqState.FINISHED]


def _admits(sched, prompt, final, ref) -> bool:
    try:
        sched.add_request(Request(99, prompt, final - prompt, adapter=ref))
    except RequestTooLargeError:
        return False
    withdraw_request(sched, 99)
    return True


def test_a_shrunk_pool_says_after_a_prompt_only_where_the_window_helps():
    # at 8 KiB a 20-token prompt does not fit whole: it read '8 tokens of one sequence at
    # most after a 20-token prompt' (a prompt longer than that); resized up, 52 after it
    from vmemkv.scheduler.errors import CacheShrunkError
    model = ModelSpec("w", 2, 4, 32, 2, weight_bytes=0, layer_windows=(8, None))
    mgr = make_manager("vmem", model, 8 * 1024, MAX_LEN, page_bytes=1024, layout="per-layer",
                       hybrid_parts=True, max_cache_bytes=32 * 1024)
    sched = Scheduler(mgr, SchedulerConfig())
    with pytest.raises(CacheShrunkError, match=r"\(8192 bytes, 8 tokens of one sequence at "
                                               r"most\); resized back up it holds 52 after a "
                                               r"20-token prompt$") as error:
        sched.add_request(Request(0, 20, 20))
    assert error.value.field == "prompt_len"
