"""An engine is driven from one thread; batch calls keep track of their own requests.

- close() while generate/stream/run_until_done runs ends every live request "aborted" and the
  call raises EngineClosedError naming how many it cut (it returned partial outputs, the
  requests "running" forever).
- another thread calling in while one is inside a call gets EngineBusyError before anything is
  touched (its failed begin() rolled back the first thread's step: vmem broken for good).
- a stream yields only its own tokens, keeps them across other calls' steps, and aborts its
  requests when closed early; a generate whose callback raised names its requests.
Overlaps are forced with threading.Event (no sleeps)."""
from __future__ import annotations

import threading

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineBusyError, EngineClosedError

from .conftest import model, prompts

KiB = 1024
VMEM = dict(cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64, check_integrity=True)
PAGED = dict(cache="paged", block_size=8, max_batch=4, max_context=64, check_integrity=True)
BOTH = pytest.mark.parametrize("options", [VMEM, PAGED], ids=["vmem", "paged"])
P = SamplingParams(max_new_tokens=10, ignore_eos=True)
BATCH, OTHER = prompts(2, 5, 12, seed=3), prompts(2, 5, 8, seed=9)


def serial(options, batch):
    with Engine(model(), **options) as ref:
        return [o.outputs[0].token_ids for o in ref.generate(batch, P)]


def at_baseline(engine) -> None:
    stats = engine.cache.manager.stats()
    assert stats.live_tokens == 0 and engine.cache.swapped_bytes == 0
    engine.cache.check_integrity()


def by_request(events):
    got: dict = {}
    for ev in events:
        got.setdefault(ev.request_id, []).append(ev.token_id)
    return got


@BOTH
def test_close_from_a_callback_aborts_and_generate_raises(options):
    want = serial(options, BATCH)
    engine = Engine(model(), **options)
    seen = []

    def on_token(ev):
        seen.append(ev)
        if len(seen) == 4:   # two steps of two requests
            engine.close()
    with pytest.raises(EngineClosedError, match="ended 2 of its 2 requests") as info:
        engine.generate(BATCH, P, on_token=on_token)
    assert info.value.request_ids == [0, 1]
    for rid, tokens in zip(info.value.request_ids, want):
        assert engine.status(rid) == "aborted"
        out = engine.output(rid, pop=True)
        assert out.status == "aborted" and out.outputs[0].finish_reason == "abort"
        assert out.outputs[0].token_ids == tokens[:2]


@BOTH
def test_close_during_run_until_done_and_stream(options):
    want = serial(options, BATCH)
    engine = Engine(model(), **options)
    ids = [engine.add_request(p, P) for p in BATCH]
    with pytest.raises(EngineClosedError, match="run_until_done: close.. ended 2"):
        engine.run_until_done(on_step=lambda events: engine.close())
    assert [engine.status(rid) for rid in ids] == ["aborted", "aborted"]
    assert [engine.output(rid).outputs[0].token_ids for rid in ids] == [w[:1] for w in want]
    engine = Engine(model(), **options)
    events = []
    with pytest.raises(EngineClosedError, match="stream: close.. ended 2 of its 2"):
        for ev in engine.stream(BATCH, P):
            events.append(ev)
            if len(events) == 1:
                engine.close()   # the step's other token is still yielded, then the error
    assert by_request(events) == {0: want[0][:1], 1: want[1][:1]}
    assert engine.status(0) == engine.status(1) == "aborted"


def overlapped(engine, inside_call):
    """Run engine.generate(BATCH) on a thread held inside its second step's planning (after
    begin()); call ``inside_call()`` there from this thread; return (its result or error,
    the generate's outputs)."""
    inside, release = threading.Event(), threading.Event()
    schedule, calls, result = engine.scheduler.schedule, [0], {}

    def held_schedule():
        calls[0] += 1
        if calls[0] == 2:
            inside.set()
            release.wait()
        return schedule()
    engine.scheduler.schedule = held_schedule

    def drive():
        result["outputs"] = engine.generate(BATCH, P)
    thread = threading.Thread(target=drive)
    thread.start()
    inside.wait()
    try:
        got = inside_call()
    except Exception as error:   # noqa: BLE001 -- the answer under test
        got = error
    release.set()
    thread.join()
    return got, result["outputs"]


@BOTH
@pytest.mark.parametrize("call", ["step", "generate", "abort", "close", "add_request",
                                  "run_until_done", "sleep", "remove_lora"])
def test_another_thread_is_refused_and_the_step_is_unaffected(options, call):
    want = serial(options, BATCH)
    engine = Engine(model(), **options)
    args = {"generate": (OTHER, P), "abort": (0,), "add_request": (OTHER[0], P),
            "remove_lora": ("none",)}.get(call, ())
    got, outputs = overlapped(engine, lambda: getattr(engine, call)(*args))
    assert isinstance(got, EngineBusyError), got
    assert f"{call}() while another thread" in str(got) and "single-threaded" in str(got)
    assert [o.status for o in outputs] == ["finished", "finished"]
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert not engine._requests and not engine.closed
    at_baseline(engine)
    assert [o.outputs[0].token_ids for o in engine.generate(BATCH, P)] == want   # still usable
    engine.close()


@BOTH
def test_a_callback_calls_back_in_from_the_driving_thread(options):
    engine = Engine(model(), **options)
    added = []

    def on_token(ev):
        if not added:
            added.append(engine.add_request(OTHER[0], P))
            engine.abort(1)
    outs = engine.generate(BATCH, P, on_token=on_token)
    assert [o.status for o in outs] == ["finished", "aborted"]
    engine.run_until_done()
    assert engine.output(added[0], pop=True).status == "finished"
    at_baseline(engine)
    engine.close()


@BOTH
def test_a_stream_closed_early_aborts_and_forgets_its_requests(options):
    with Engine(model(), **options) as engine:
        stream = engine.stream(BATCH, P)
        for i, _ in enumerate(stream):
            if i == 1:
                break
        del stream            # GeneratorExit (as garbage collection does)
        assert not engine._requests
        at_baseline(engine)
        engine.generate(OTHER[:1], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert engine.last_stats.steps == 3


@BOTH
def test_a_stream_keeps_its_tokens_across_other_calls(options):
    want, other = serial(options, BATCH), serial(options, OTHER)
    with Engine(model(), **options) as engine:
        stream = engine.stream(BATCH, P)
        events = [next(stream), next(stream)]
        outs = engine.generate(OTHER, P)   # steps the stream's requests too
        assert [o.outputs[0].token_ids for o in outs] == other
        events += list(stream)
        assert by_request(events) == {0: want[0], 1: want[1]}
        assert [o.outputs[0].token_ids for o in engine.last_outputs] == want
        at_baseline(engine)


@BOTH
def test_interleaved_streams_yield_their_own_requests(options):
    want, other = serial(options, BATCH), serial(options, OTHER)
    with Engine(model(), **options) as engine:
        s1, s2 = engine.stream(BATCH, P), engine.stream(OTHER, P)
        ev1, ev2 = [next(s1)], []
        for a, b in zip(s1, s2):
            ev1.append(a)
            ev2.append(b)
        ev1 += list(s1)
        ev2 += list(s2)
        assert by_request(ev1) == {0: want[0], 1: want[1]}
        assert by_request(ev2) == {2: other[0], 3: other[1]}
        at_baseline(engine)


@BOTH
def test_a_raising_callback_names_the_requests_it_leaves(options):
    want = serial(options, BATCH)
    with Engine(model(), **options) as engine:
        def on_token(ev):
            if ev.index == 0 and ev.request_id == 1 and engine.output(1).outputs[0].token_ids \
                    == want[1][:2]:
                raise ValueError("client callback failed")
        with pytest.raises(ValueError) as info:
            engine.generate(BATCH, P, on_token=on_token)
        assert info.value.request_ids == [0, 1]
        engine.run_until_done()    # documented: the requests stay, a resume finishes them
        outs = [engine.output(rid, pop=True) for rid in info.value.request_ids]
        assert [o.outputs[0].token_ids for o in outs] == want
        assert not engine._requests
        at_baseline(engine)


@BOTH
def test_a_step_called_from_inside_a_step_is_refused_and_touches_nothing(options):
    want = serial(options, BATCH)
    engine = Engine(model(), **options)
    schedule, refused = engine.scheduler.schedule, []

    def nested_schedule():   # the driving thread itself, inside the step's planning
        if not refused:
            with pytest.raises(EngineBusyError, match="inside a step under way") as info:
                engine.step()
            refused.append(info.value)
        return schedule()
    engine.scheduler.schedule = nested_schedule
    outs = engine.generate(BATCH, P)
    assert refused and [o.outputs[0].token_ids for o in outs] == want
    at_baseline(engine)
    engine.close()
