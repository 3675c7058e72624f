"""``reset()`` called by one thread while another thread's forward on the same VMemCache is
part-way (a UI's "clear" while a generate streams in a worker): the forward's remaining layers
are refused (CacheStateError, nothing written), never run over the emptied rows.

Before, the guard forgot the open forward at reset() and let it go on: its upper layers wrote
their new tokens at position 0 of the emptied rows and attended over those alone: a generate
with no attention mask went on with wrong tokens and nothing said so, one with a mask failed
in torch on the sizes (untyped), and the cache was left with layers of different lengths. The thread may start over (a forward from layer 0 runs); another thread's
reset() stays the recovery after a forward that raised part-way (runtime/hf/cache_guard.py)."""
from __future__ import annotations

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.errors import CacheStateError  # noqa: E402
from vmemkv.runtime.hf import VMemCache  # noqa: E402

from .test_vmem_cache_threads import IDS, WAIT_S, generate, llama  # noqa: E402


def test_a_forward_open_in_another_thread_at_reset_is_refused_then_may_start_over():
    model = llama()
    want = generate(model, None, ids=IDS[:1])
    cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=64)
    with torch.no_grad():
        model(IDS[:1, :4], cache=cache, use_cache=True)         # a prefix of 4 tokens
    inside, go, outcome = threading.Event(), threading.Event(), {}

    def pause(module, args, kwargs):
        if threading.current_thread().name == "A" and not inside.is_set():
            inside.set()
            go.wait(WAIT_S)

    def a_forwards():
        with torch.no_grad():
            try:
                model(IDS[:1, 4:6], cache=cache, use_cache=True)    # paused before layer 1
                outcome["continued"] = "ran"
            except Exception as error:      # noqa: BLE001 (before: a RuntimeError, or none)
                outcome["continued"] = error
            model(IDS[:1, :3], cache=cache, use_cache=True)         # starts over at layer 0
            outcome["lengths"] = [layer.get_seq_length() for layer in cache.layers]

    hook = model.model.layers[1].register_forward_pre_hook(pause, with_kwargs=True)
    thread = threading.Thread(target=a_forwards, name="A")
    try:
        thread.start()
        assert inside.wait(WAIT_S)
        cache.reset()
        go.set()
        thread.join(WAIT_S)
    finally:
        hook.remove()
    assert isinstance(outcome["continued"], CacheStateError)
    assert "reset()" in str(outcome["continued"]) and "nothing was written" in str(outcome["continued"])
    assert outcome["lengths"] == [3, 3]
    cache.reset()
    assert torch.equal(generate(model, cache, ids=IDS[:1]), want)
    cache.close()
