"""Engine.abort ends a request wherever it is (waiting, running, preempted for recompute,
swapped) and releases its memory at once; the other requests still produce exactly
transformers' greedy tokens. Unknown and already ended ids are typed errors that change
nothing. A request whose prompt prefix another sequence hit before computing it can be aborted:
the sequence that hit recomputes and its output stays exact."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import RequestEndedError, UnknownRequestError

from .conftest import hf_greedy, model, prompts, tokens

KiB = 1024
VMEM = dict(cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64, check_integrity=True)
PAGED = dict(cache="paged", block_size=8, max_batch=4, max_context=64, check_integrity=True)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def finish_and_check(engine, ids, batch, aborted):
    """Run the rest; every other request is exact, the aborted one keeps a prefix of its
    tokens; nothing is held afterwards."""
    engine.run_until_done()
    out = [engine.output(rid, pop=True) for rid in ids]
    want = hf_greedy("tiny-llama", batch, 12, ignore_eos=True)
    for i, o in enumerate(out):
        if i == aborted:
            got = o.outputs[0].token_ids
            assert o.status == "aborted" and got == want[i][:len(got)] and o.error is None
            assert o.outputs[0].finish_reason == "abort" or len(got) == 12
        else:
            assert o.status == "finished" and tokens([o])[0] == want[i], i
    stats = engine.cache.manager.stats()
    assert stats.live_tokens == 0 and engine.cache.swapped_bytes == 0
    assert engine.scheduler.seqs == {}   # no record of an ended sequence is kept, aborted too
    engine.cache.check_integrity()
    return out


@pytest.mark.parametrize("options", [VMEM, PAGED], ids=["vmem", "paged"])
def test_abort_a_waiting_request(options):
    batch = prompts(3, 8, 20, seed=1)
    with Engine(model(), **dict(options, max_batch=1)) as engine:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        engine.step()
        assert engine.status(ids[2]) == "waiting"
        out = engine.abort(ids[2])
        assert out.status == "aborted" and engine.status(ids[2]) == "aborted"
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "abort"
        finish_and_check(engine, ids, batch, aborted=2)


@pytest.mark.parametrize("options", [VMEM, PAGED], ids=["vmem", "paged"])
def test_abort_a_running_request_releases_its_memory_now(options):
    batch = prompts(3, 8, 20, seed=2)
    with Engine(model(), **options) as engine:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        for _ in range(4):
            engine.step()
        assert engine.status(ids[1]) == "running"
        live = engine.cache.manager.stats().live_tokens
        engine.abort(ids[1])
        assert engine.cache.manager.stats().live_tokens == live - (len(batch[1]) + 3)
        engine.cache.check_integrity()
        finish_and_check(engine, ids, batch, aborted=1)


def test_abort_a_request_preempted_for_recompute():
    batch = prompts(4, 20, 30, seed=3)
    # 4 page groups of 32 tokens: four sequences of 20-30 + 12 tokens cannot all stay
    with Engine(model(), **dict(VMEM, cache_bytes=4 * 16 * KiB)) as engine:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        while engine.scheduler.metrics.num_preemptions == 0:
            engine.step()
        victim = next(i for i, rid in enumerate(ids) if engine.status(rid) == "waiting")
        engine.abort(ids[victim])
        finish_and_check(engine, ids, batch, aborted=victim)


@pytest.mark.parametrize("options", [VMEM, PAGED], ids=["vmem", "paged"])
def test_abort_a_swapped_request_frees_its_swap_space(options):
    batch = prompts(4, 20, 30, seed=3)
    tight = dict(cache_bytes=4 * 16 * KiB) if options is VMEM else dict(cache_bytes=4 * 32 * 512)
    with Engine(model(), preemption="swap", swap_bytes=1 << 20, **dict(options, **tight)) as engine:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        while not any(engine.status(rid) == "swapped" for rid in ids):
            assert engine.has_unfinished(), "nothing was ever swapped"
            engine.step()
        victim = next(i for i, rid in enumerate(ids) if engine.status(rid) == "swapped")
        engine.abort(ids[victim])
        assert engine.cache.swapped_bytes == 0
        finish_and_check(engine, ids, batch, aborted=victim)


def test_unknown_and_ended_ids_are_typed_errors_that_change_nothing():
    batch = prompts(2, 8, 12, seed=4)
    with Engine(model(), **VMEM) as engine:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        engine.abort(ids[0])
        engine.run_until_done()
        stats = engine.cache.manager.stats()
        for rid, error, words in [(ids[0], RequestEndedError, [str(ids[0]), "aborted"]),
                                  (ids[1], RequestEndedError, [str(ids[1]), "finished"]),
                                  (99, UnknownRequestError, ["99", "unknown"])]:
            with pytest.raises(error) as info:
                engine.abort(rid)
            assert all(w in str(info.value) for w in words), str(info.value)
        assert engine.cache.manager.stats() == stats and not engine.has_unfinished()
        engine.output(ids[1], pop=True)
        with pytest.raises(UnknownRequestError, match=f"request id {ids[1]}"):
            engine.abort(ids[1])


def test_abort_from_a_token_callback_stops_that_request_at_once():
    batch = prompts(3, 8, 20, seed=5)
    with Engine(model(), **VMEM) as engine:
        ids = []

        def stop_after_three(event):
            if event.request_id == ids[0] and len(engine.output(ids[0]).outputs[0].token_ids) == 3:
                engine.abort(ids[0])
        ids.extend(engine.add_request(p, GREEDY, on_token=stop_after_three) for p in batch)
        out = finish_and_check(engine, ids, batch, aborted=0)
    assert len(out[0].outputs[0].token_ids) == 3


def test_abort_a_request_whose_prefix_another_sequence_hit():
    """E prefills in chunks; A (E's prefix + its own) and B (A's prompt + more) are admitted
    while E computes. Publish on compute: their hits name only units already computed, so
    aborting A (whose units B may share) leaves B reading only written K/V."""
    e = prompts(1, 100, 100, seed=6)[0]
    a = e[:64] + prompts(1, 64, 64, seed=7)[0]
    b = a[:128] + prompts(1, 10, 10, seed=8)[0]
    batch = [e, a, b]
    options = dict(VMEM, max_context=192, max_tokens_per_step=40, prefix_sharing=True)
    with Engine(model(), **options) as engine:
        ids = [engine.add_request(p, GREEDY) for p in batch]
        for _ in range(4):
            engine.step()
        engine.abort(ids[1])
        finish_and_check(engine, ids, batch, aborted=1)
        assert engine.cache.manager.prefix_hits >= 64


def test_status_is_the_furthest_along_of_a_requests_samples():
    """A request whose samples are one running and one swapped out is "running" (its
    furthest along), not "swapped"; it finishes every sample."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, n=2, temperature=1.0, seed=1)
    # 2 page groups of 32 tokens: two samples of 20 + 30 tokens cannot both stay
    with Engine(model(), preemption="swap", swap_bytes=1 << 20,
                **dict(VMEM, cache_bytes=2 * 16 * KiB)) as engine:
        rid = engine.add_request(prompts(1, 20, 20, seed=3)[0], params)
        while not (engine.scheduler.running and engine.scheduler.swapped):
            assert engine.has_unfinished(), "no sample was ever swapped out beside a running one"
            engine.step()
        assert engine.status(rid) == "running"
        engine.run_until_done()
        out = engine.output(rid, pop=True)
    assert out.status == "finished" and [len(c.token_ids) for c in out.outputs] == [30, 30]
