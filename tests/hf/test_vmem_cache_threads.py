"""One VMemCache used by two threads' generate calls at once is refused, both of them, instead of
both answering wrong tokens (it was: one cache holds one batch's rows); a cache handed from one
thread to another between generate calls keeps working. The overlap is forced, not timed: A's
forward waits before its layer 1 until B's generate on the same cache has returned or raised."""
from __future__ import annotations

import threading

import pytest
import torch

from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.hf import VMemCache

transformers = pytest.importorskip("transformers")

WAIT_S = 60.0   # only a guard against hanging: the wait is released by B's end
IDS = torch.tensor([[3, 9, 27, 81, 5, 15, 45], [2, 4, 8, 16, 32, 64, 1]])


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()


def generate(model, cache, ids=IDS, new_tokens=6):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, cache=cache)


def test_two_threads_generating_on_one_cache_are_both_refused_and_reset_recovers_it():
    model = llama()
    plain = generate(model, None)
    cache = VMemCache.from_model_config(model.config, max_batch=2, max_context=64)
    b_ended, outcome = threading.Event(), {}

    def b_generate():
        try:
            outcome["b"] = generate(model, cache)
        except Exception as error:
            outcome["b"] = error
        finally:
            b_ended.set()
    b = threading.Thread(target=b_generate)

    def before_layer_1(module, args):
        if threading.current_thread() is threading.main_thread() and not b.is_alive() \
                and not b_ended.is_set():   # A's first forward, between its layers 0 and 1
            b.start()
            assert b_ended.wait(WAIT_S)
    hook = model.model.layers[1].register_forward_pre_hook(before_layer_1)
    try:
        with pytest.raises(CacheStateError, match="two threads' forwards"):
            generate(model, cache)                    # A: its layer 1 is refused after the clash
    finally:
        hook.remove()
        b_ended.set()
        b.join(WAIT_S)
    assert isinstance(outcome["b"], CacheStateError)   # B: its layer 0, A's forward being open
    assert "in use by another thread's forward" in str(outcome["b"])
    with pytest.raises(CacheStateError, match="reset"):
        generate(model, cache)                        # refused until reset(), on any thread
    cache.reset()
    assert torch.equal(generate(model, cache), plain)
    cache.close()


def test_a_cache_continued_on_another_thread_between_generate_calls_gives_the_same_tokens():
    model = llama()
    with VMemCache.from_model_config(model.config, max_batch=2, max_context=64) as one_thread:
        first = generate(model, one_thread, new_tokens=3)
        serial = generate(model, one_thread, ids=first, new_tokens=3)
    with VMemCache.from_model_config(model.config, max_batch=2, max_context=64) as handed:
        first_here = generate(model, handed, new_tokens=3)
        out = {}
        t = threading.Thread(target=lambda: out.update(
            tokens=generate(model, handed, ids=first_here, new_tokens=3)))
        t.start()
        t.join(WAIT_S)
        assert torch.equal(first_here, first) and torch.equal(out["tokens"], serial)
