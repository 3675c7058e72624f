"""A second Engine built on the same model object on another thread while the first generates.

B's self-check (or, without one, its kv-scale calibration) switches the model-wide attention
implementation (to sdpa for its reference forward). Without a lock A's forward ran while the model was on sdpa: it skipped the KV cache
and its tokens changed, with no error. The overlap is forced, not timed: A's third forward waits
(inside its forward) until B asks for the model's lock (or, with no lock, switches the model),
and B's reference forward waits until A's forward is over.
"""
from __future__ import annotations

import threading

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.hf import attention
from vmemkv.runtime.hf.attention import ATTN_IMPLEMENTATION
from vmemkv.runtime.models import build_model

from .conftest import prompts

WAIT_S = 60.0   # only a guard against hanging: each wait is released by the other thread's event
OPTIONS = {"vmem": dict(cache="vmem", page_bytes=4096, max_batch=4, max_context=64),
           "paged": dict(cache="paged", block_size=8, max_batch=4, max_context=64)}
# B: the self-check's switch, or (no self-check) kv-scale calibration's switch alone
B_OPTIONS = {"self-check": {}, "calibration": dict(self_check=False, kv_cache_dtype="int8",
                                                  kv_scales="calibrate")}


class _SignalingLock:
    """An RLock that says when a thread other than the main one asks for it."""

    def __init__(self, asked: threading.Event) -> None:
        self._lock, self._asked = threading.RLock(), asked

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            self._asked.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


@pytest.mark.parametrize("b_switch", sorted(B_OPTIONS))
@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_engine_built_on_another_thread_leaves_a_running_engines_tokens_alone(cache, b_switch,
                                                                              monkeypatch):
    model = build_model("tiny-llama", seed=0)
    b_switching, a_forward_done = threading.Event(), threading.Event()
    monkeypatch.setattr(attention, "_LOCKS", {model: _SignalingLock(b_switching)}, raising=False)
    switch = model.set_attn_implementation

    def set_attn(name):   # the old code switched without a lock: that is B's attempt then
        on_b = threading.current_thread() is not threading.main_thread()
        if on_b and name != ATTN_IMPLEMENTATION:
            b_switching.set()
        return switch(name)
    monkeypatch.setattr(model, "set_attn_implementation", set_attn)

    batch, params = prompts(4, 5, 12, seed=11), SamplingParams(max_new_tokens=8, ignore_eos=True)
    a = Engine(model, **OPTIONS[cache])
    serial = [o.outputs[0].token_ids for o in a.generate(batch, params)]
    main_forwards, built, b_errors = [0], [], []

    def build_b():
        try:
            Engine(model, **OPTIONS[cache], **B_OPTIONS[b_switch]).close()
            built.append(True)
        except Exception as error:   # reported by the assert below
            b_errors.append(error)
    b = threading.Thread(target=build_b)

    def before_forward(module, args):
        if threading.current_thread() is threading.main_thread():
            main_forwards[0] += 1
            if main_forwards[0] == 3:   # a decode step of A: B starts switching now
                b.start()
                assert b_switching.wait(WAIT_S)
        elif model.config._attn_implementation != ATTN_IMPLEMENTATION:   # B's reference forward
            assert a_forward_done.wait(WAIT_S)

    def after_forward(module, args, out):
        if threading.current_thread() is threading.main_thread() and main_forwards[0] == 3:
            a_forward_done.set()
    hooks = [model.register_forward_pre_hook(before_forward),
             model.register_forward_hook(after_forward)]
    try:
        got = [o.outputs[0].token_ids for o in a.generate(batch, params)]
    finally:
        a_forward_done.set()
        b.join(WAIT_S)
        for hook in hooks:
            hook.remove()
    assert built == [True] and not b_errors
    assert got == serial
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION   # A still holds it
    a.close()
    assert model.config._attn_implementation != ATTN_IMPLEMENTATION
