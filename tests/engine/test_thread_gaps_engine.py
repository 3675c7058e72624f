"""Thread gaps of the one-thread-at-a-time rule (hunt_race2 findings 3, 4, 5, 7).

- an engine built on a model while another engine on it closes: the model ends on its own
  attention once both are closed (it was left on "vmemkv" for good: the builder read the
  model's implementation, "vmemkv", long before counting itself on it).
- a stream closed on a thread other than the one inside the engine: its request is aborted
  and dropped by that thread at its next step (close() raised EngineBusyError and the request
  ran on for nobody, kept in the engine for ever).
- output(rid, pop=True) and add_all from another thread: EngineBusyError naming them, nothing
  changed (the pop was accepted and the running generate() lost its outputs).
- step() from an on_token callback: the refusal says what to do instead.
Overlaps are forced with threading.Event at real points (no sleeps)."""
from __future__ import annotations

import gc
import threading

import pytest

import vmemkv.runtime.engine.engine as engine_module
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineBusyError, UnknownRequestError
from vmemkv.runtime.hf.attention import ATTN_IMPLEMENTATION

from .conftest import model, prompts

KiB = 1024
VMEM = dict(cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64, check_integrity=True)
P = SamplingParams(max_new_tokens=6, ignore_eos=True)
WAIT_S = 30   # only a hung test waits this long


def run_in_thread(target) -> tuple:
    """Start ``target`` on a thread; returns (thread, box): box["out"] or box["err"]."""
    box: dict = {}

    def run():
        try:
            box["out"] = target()
        except BaseException as error:   # reported by the test, not lost on the thread
            box["err"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def holding_on_first_token():
    """An on_token callback that holds the engine's thread at its first token (inside the
    engine, between the step's record and its end) until ``release`` is set."""
    held, release = threading.Event(), threading.Event()

    def on_token(event):
        if not held.is_set():
            held.set()
            assert release.wait(WAIT_S)
    return on_token, held, release


def finish(thread, box, release) -> list:
    release.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    if "err" in box:
        raise box["err"]
    return box["out"]


def test_an_engine_built_while_another_closes_leaves_the_model_on_its_own_attention(monkeypatch):
    tiny = model()
    own = tiny.config._attn_implementation
    first = Engine(tiny, **VMEM)
    inside, go = threading.Event(), threading.Event()
    real_self_check = engine_module.self_check

    def paused_self_check(*args, **kwargs):   # the second engine is part-way built
        inside.set()
        assert go.wait(WAIT_S)
        return real_self_check(*args, **kwargs)
    monkeypatch.setattr(engine_module, "self_check", paused_self_check)
    thread, box = run_in_thread(lambda: Engine(tiny, **VMEM, self_check=True))
    assert inside.wait(WAIT_S)
    first.close()                              # the first engine closes meanwhile
    second = finish(thread, box, go)
    assert tiny.config._attn_implementation == ATTN_IMPLEMENTATION   # the second runs on it
    outputs = second.generate(prompts(1, 5, 8), P)
    assert [o.status for o in outputs] == ["finished"]
    assert len(outputs[0].outputs[0].token_ids) == 6
    second.close()
    assert tiny.config._attn_implementation == own


def test_a_stream_closed_on_another_thread_is_dropped_by_the_engine_thread():
    with Engine(model(), **VMEM) as reference:
        want = reference.generate(prompts(1, 5, 8, seed=3), P)[0].outputs[0].token_ids
    engine = Engine(model(), **VMEM)
    stream = engine.stream(prompts(1, 5, 8, seed=2),
                           SamplingParams(max_new_tokens=20, ignore_eos=True))
    streamed = next(stream).request_id
    on_token, held, release = holding_on_first_token()
    thread, box = run_in_thread(
        lambda: engine.generate(prompts(1, 5, 8, seed=3), P, on_token=on_token))
    assert held.wait(WAIT_S)
    stream.close()          # this thread is not the one inside: handed to it (was EngineBusyError)
    outputs = finish(thread, box, release)
    assert outputs[0].status == "finished" and outputs[0].outputs[0].token_ids == want
    with pytest.raises(UnknownRequestError):   # aborted and dropped by generate's next step
        engine.status(streamed)
    assert list(engine._requests) == [] and not engine.has_unfinished()
    assert engine.cache.manager.stats().live_tokens == 0
    engine.cache.check_integrity()
    engine.close()


def test_another_threads_pop_of_a_running_generates_request_is_refused():
    engine = Engine(model(), **VMEM)
    held, release = threading.Event(), threading.Event()

    def on_token(event):     # request 0 has finished; generate still runs request 1
        if event.request_id == 0 and event.finished and not held.is_set():
            held.set()
            assert release.wait(WAIT_S)
    short = SamplingParams(max_new_tokens=2, ignore_eos=True)
    thread, box = run_in_thread(
        lambda: engine.generate(prompts(2, 5, 8, seed=1), [short, P], on_token=on_token))
    assert held.wait(WAIT_S)
    with pytest.raises(EngineBusyError, match=r"^output\(\) while another thread"):
        engine.output(0, pop=True)
    with pytest.raises(EngineBusyError, match=r"^add_all\(\) while another thread"):
        engine.add_all(lambda i: engine.add_request([1, 2, 3]), 1)
    assert engine.output(0).status == "finished"   # reading (no pop) is not a change
    outputs = finish(thread, box, release)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 6]
    assert [o.status for o in outputs] == ["finished", "finished"]
    assert list(engine._requests) == []            # add_all queued nothing
    engine.close()


def test_step_from_on_token_is_refused_with_what_a_callback_may_do():
    engine = Engine(model(), **VMEM)
    refusals = []

    def on_token(event):
        if not refusals:
            with pytest.raises(EngineBusyError) as info:
                engine.step()
            refusals.append(str(info.value))
    outputs = engine.generate(prompts(1, 5, 8), P, on_token=on_token)
    assert len(outputs[0].outputs[0].token_ids) == 6
    assert "on_token instead" not in refusals[0]
    assert "return and let the caller's loop step" in refusals[0]
    assert "add_request, abort or close" in refusals[0]
    engine.close()


def test_a_stream_closed_inside_a_step_on_its_thread_is_dropped_after_the_step():
    """A stream closed (or garbage-collected) on the engine's own thread inside a step (here a
    forward hook) aborted its request there and then: the step under way failed with
    TransactionStateError ("begin() in phase planning"). It is dropped after the step now."""
    net = model()
    with Engine(net, **VMEM) as engine:
        stream = engine.stream([[5, 6, 7, 8]], P)
        next(stream)
        other = engine.add_request([9, 10, 11], P)
        closed = []
        hook = net.model.layers[0].register_forward_pre_hook(
            lambda module, args: None if closed else closed.append(stream.close()))
        try:
            engine.step()
        finally:
            hook.remove()
        assert closed and engine.status(other) == "running"
        engine.run_until_done()
        assert engine.output(other).outputs[0].token_ids == \
            engine.generate([[9, 10, 11]], P)[0].outputs[0].token_ids
        assert list(engine._requests) == [other]      # the stream's request was dropped
        engine.scheduler.manager.check_integrity()


@pytest.mark.parametrize("call", ["close", "abort"])
def test_a_stream_collected_inside_another_engine_call_is_dropped_after_it(call, monkeypatch):
    """The garbage collector closing a stream inside close() or abort(other) on the engine's
    thread: its abort ran there and then (close: RuntimeError "dictionary changed size during
    iteration", the engine left open; abort: TransactionStateError swallowed by the collector
    and the request left running for nobody, kept for ever). It waits for the call to end."""
    with Engine(model(), **VMEM) as engine:
        other = engine.add_request([9, 10, 11], P)
        stream = engine.stream([[5, 6, 7, 8]], P)
        next(stream)
        mine = max(engine._requests)
        cycle = [stream]
        cycle.append(cycle)
        del stream, cycle                          # only the cyclic collector frees it
        target = engine if call == "close" else engine.scheduler
        name = "_end_beams" if call == "close" else "abort_request"
        original = getattr(target, name)
        monkeypatch.setattr(target, name, lambda *a: (gc.collect(), original(*a))[1])
        gc.disable()
        try:
            getattr(engine, call)(*(() if call == "close" else (other,)))
        finally:
            gc.enable()
            monkeypatch.undo()
        if call == "close":
            assert engine.closed and not engine._requests.get(mine)
            return
        assert engine._forgotten == [mine] and engine.status(mine) == "running"
        engine.step()                              # the thread inside drops it at its next step
        assert mine not in engine._requests and engine._forgotten == []
        engine.scheduler.manager.check_integrity()
