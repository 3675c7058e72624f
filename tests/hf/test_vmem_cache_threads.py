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


def _forward_paused_in_layer(model, cache, layer, ids):
    """Thread A's forward on ``cache`` waits before ``layer`` while the caller runs; returns
    (A's thread, release, A's outcome)."""
    inside, go, outcome = threading.Event(), threading.Event(), {}

    def pause(module, args, kwargs):
        if threading.current_thread().name == "A":
            inside.set()
            go.wait(WAIT_S)

    hook = model.model.layers[layer].register_forward_pre_hook(pause, with_kwargs=True)

    def a_forward():
        try:
            with torch.no_grad():          # grad mode is per thread: the caller's is not A's
                model(ids, cache=cache, use_cache=True)
            outcome["A"] = "ran"
        except CacheStateError as error:
            outcome["A"] = error
        finally:
            hook.remove()

    thread = threading.Thread(target=a_forward, name="A")
    thread.start()
    assert inside.wait(WAIT_S)
    return thread, go, outcome


def test_after_an_interrupted_forward_a_retry_and_reset_a_second_thread_is_still_refused():
    """Before, the guard took the retry for a model whose top layers never write (Gemma 3n) and
    lowered its top layer for good: a second thread's forward then wrote under the first one's,
    which answered wrong logits silently."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    cache = VMemCache.from_model_config(model.config, max_batch=1, max_context=64)
    ids = IDS[:1, :6]

    def interrupt(module, args, kwargs):
        raise KeyboardInterrupt("Ctrl-C in layer 2")

    hook = model.model.layers[2].register_forward_pre_hook(interrupt, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    hook.remove()
    with pytest.raises(CacheStateError, match="raised part-way"), torch.no_grad():
        model(ids[:, :1], cache=cache, use_cache=True)         # the same thread starts over
    cache.reset()
    with torch.no_grad():
        thread, go, outcome = _forward_paused_in_layer(model, cache, 2, ids)
        with pytest.raises(CacheStateError, match="another thread"):
            model(ids, cache=cache, use_cache=True)
        go.set()
        thread.join(WAIT_S)
    assert isinstance(outcome["A"], CacheStateError)     # the clash poisons both, until reset()
    cache.close()


def test_a_model_on_the_engines_attention_is_refused_before_the_cache_is_written():
    """It was refused by the attention function, after layer 0's K/V were written: a retry on
    the model's own attention then failed on the stale rows."""
    from vmemkv.runtime.hf.attention import use_vmemkv_attention
    model = llama()
    want = generate(model, None)
    own = model.config._attn_implementation
    cache = VMemCache.from_model_config(model.config, max_batch=2, max_context=64)
    use_vmemkv_attention(model)
    with pytest.raises(CacheStateError, match="'vmemkv' attention"):
        generate(model, cache)
    assert [layer.get_seq_length() for layer in cache.layers] == [0, 0]
    model.set_attn_implementation(own)
    assert torch.equal(generate(model, cache), want)
    cache.close()
