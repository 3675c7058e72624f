"""Bad input to the HF integration (VMemCache, the vmemkv attention function) and to model
loading (docs/errors.md, sections "HF integration" and "models"): type, message words, and
nothing changed afterwards."""
from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import CacheConfigError, CacheStateError, RuntimeKVError
from vmemkv.runtime.hf.attention import StepContext, UnsupportedModelError, vmemkv_attention
from vmemkv.runtime.hf.cache import (BatchTooLargeError, CacheCapacityError, ContextOverflowError,
                              VMemCache, cache_config_from_model)
from vmemkv.runtime.models import ModelLoadError, build_model, load_model, model_config


from .conftest import assert_words


# ---- HF integration: VMemCache -----------------------------------------------------------
def kv(batch, tokens, heads=2, head_dim=16, dtype=torch.float32):
    return torch.randn(batch, heads, tokens, head_dim, dtype=dtype), \
        torch.randn(batch, heads, tokens, head_dim, dtype=dtype)


def hf_cache(model):
    # 32 tokens per page per layer; cache_bytes: 2 page groups = 64 token-rows in all
    return VMemCache.from_model_config(model.config, max_batch=2, max_context=40,
                                       page_bytes=4096, cache_bytes=8 * 4096)


def vmemcache_state(cache):
    k, v = cache.kv.layer_tensors(0)
    n = cache._written[0]
    return (cache.stats(), cache.manager.stats(), list(cache._written), list(cache._rows),
            k[:len(cache._rows), :n].clone(), v[:len(cache._rows), :n].clone())


def same_state(a, b):
    return a[:4] == b[:4] and torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])


EMPTY_CACHE_CASES = [
    ("batch-too-large", lambda c: c.update(*kv(3, 4), 0), BatchTooLargeError,
     ["batch of 3 rows", "max_batch=2"]),
    ("context-overflow", lambda c: c.update(*kv(1, 41), 0), ContextOverflowError,
     ["sequence length 41", "max_context=40"]),
    ("wrong-heads", lambda c: c.update(*kv(1, 4, heads=3), 0), CacheStateError,
     ["(batch, 2, tokens, 16)", "(1, 3, 4, 16)"]),
    ("wrong-dtype", lambda c: c.update(*kv(1, 4, dtype=torch.float64), 0), CacheStateError,
     ["torch.float64", "holds torch.float32"]),
    ("key-value-differ", lambda c: c.update(kv(1, 4)[0], kv(1, 5)[1], 0), CacheStateError,
     ["(1, 2, 4, 16)", "(1, 2, 5, 16)", "differ"]),
    ("negative-layer", lambda c: c.update(*kv(1, 4), -1), CacheStateError,
     ["layer_idx", "[0, 2)", "got -1"]),
    ("layer-past-the-end", lambda c: c.update(*kv(1, 4), 2), CacheStateError,
     ["layer_idx", "[0, 2)", "got 2"]),
]

HELD_CACHE_CASES = [   # a batch of 2 rows holding 10 tokens each
    ("overflow-while-growing", lambda c: c.update(*kv(2, 31), 0), ContextOverflowError,
     ["sequence length 41", "max_context=40", "batch of 2 rows"]),
    ("out-of-pages", lambda c: c.update(*kv(2, 23), 0), CacheCapacityError,
     ["2 rows to 33 tokens", "needs 2 page groups", "32 tokens", "has 0 left"]),
    ("batch-changed", lambda c: c.update(*kv(1, 1), 0), CacheStateError,
     ["batch of 1 rows", "holds a batch of 2", "reset()"]),
    ("batch-changed-growing", lambda c: c.update(*kv(3, 30), 0), CacheStateError,
     ["batch of 3 rows", "holds a batch of 2"]),
    ("crop-positive", lambda c: c.crop(3), CacheStateError, ["negative count", "got 3"]),
    ("repeat-interleave", lambda c: c.batch_repeat_interleave(2), CacheStateError, ["static batch"]),
    ("select-indices", lambda c: c.batch_select_indices(torch.tensor([0])), CacheStateError,
     ["static batch"]),
]


@pytest.mark.parametrize("held", [False, True], ids=["empty", "held"])
def test_vmemcache_errors_change_nothing(model, held):
    cache = hf_cache(model)
    try:
        if held:
            for layer in range(2):
                cache.update(*kv(2, 10), layer)
        for name, action, error, words in (HELD_CACHE_CASES if held else EMPTY_CACHE_CASES):
            before = vmemcache_state(cache)
            with pytest.raises(error) as info:
                action(cache)
            assert isinstance(info.value, CacheStateError), name
            assert_words(info.value, words)
            assert same_state(vmemcache_state(cache), before), name
            cache.manager.check_integrity()
            cache.kv.check_integrity()
        if held:   # still usable: grow within the budget, then a new batch after reset
            cache.update(*kv(2, 5), 0)
            cache.reset()
            cache.update(*kv(1, 40), 0)
    finally:
        cache.close()
    with pytest.raises(CacheStateError, match=r"after close\(\)"):
        cache.update(*kv(1, 1), 0)


def test_vmemcache_error_hierarchy():
    assert issubclass(CacheCapacityError, MemoryError) and issubclass(CacheCapacityError, CacheStateError)
    for cls in (BatchTooLargeError, ContextOverflowError, CacheCapacityError):
        assert issubclass(cls, ValueError) and issubclass(cls, RuntimeKVError)


def test_vmemcache_config_errors(model):
    other = SimpleNamespace(layer_types=["full_attention", "linear_attention"], num_attention_heads=4,
                            hidden_size=64, num_hidden_layers=2)
    with pytest.raises(CacheConfigError) as info:
        cache_config_from_model(other, max_batch=1, max_context=16)
    assert_words(info.value, ["'full_attention', 'sliding_attention'", "['linear_attention']"])
    with pytest.raises(CacheConfigError) as info:
        VMemCache.from_model_config(model.config, max_batch=0, max_context=16)
    assert_words(info.value, ["CacheConfig.max_batch", "0"])


# ---- HF integration: the vmemkv attention function ---------------------------------------
class RecordingCache:
    def __init__(self, max_context=64):
        self.config = SimpleNamespace(max_context=max_context, window_of=lambda layer: None)
        self.writes = []

    def write(self, *args):
        self.writes.append(args)

    def layer_view(self, layer):   # one sequence of max_context tokens this step
        return SimpleNamespace(lens=SimpleNamespace(context_lens=(self.config.max_context,)))


def attention_call(batch=1, ctx=True, module=None, **kwargs):
    cache = RecordingCache()
    module = module or SimpleNamespace(layer_idx=1, is_causal=True)
    q = torch.zeros(batch, 4, 3, 16)
    k = torch.zeros(batch, 2, 3, 16)
    if ctx:
        kwargs["vmemkv_step"] = StepContext(cache, backend=None)
    return cache, (lambda: vmemkv_attention(module, q, k, k, None, **kwargs))


UNSUPPORTED_CASES = [
    ("no-step-context", dict(ctx=False), ["vmemkv_step=StepContext", "vmemkv.runtime.engine"]),
    ("batched", dict(batch=2), ["packed batches [1, tokens, ...]", "batch of 2"]),
    ("sinks", dict(s_aux=torch.zeros(4)), ["layer 1", "attention sinks (s_aux)"]),
    ("window-not-the-caches", dict(sliding_window=16), ["layer 1", "sliding window of 16",
                                                         "cache was built for None"]),
    ("not-causal", dict(module=SimpleNamespace(layer_idx=1, is_causal=False)), ["layer 1", "not causal"]),
]


@pytest.mark.parametrize("kwargs,words", [pytest.param(*c[1:], id=c[0]) for c in UNSUPPORTED_CASES])
def test_unsupported_model_error_writes_nothing(kwargs, words):
    cache, call = attention_call(**kwargs)
    with pytest.raises(UnsupportedModelError) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeKVError)
    assert_words(info.value, words)
    assert cache.writes == []


def test_an_unsupported_model_is_refused_when_the_engine_is_built():
    from transformers import AutoModelForCausalLM
    config = model_config("tiny-qwen2")
    config.use_bidirectional_attention = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        qwen = AutoModelForCausalLM.from_config(config).eval()
    engine = None
    try:
        with pytest.raises(UnsupportedModelError, match="bidirectional attention"):
            engine = Engine(qwen, cache="paged", block_size=8, max_batch=2, max_context=32)
    finally:
        if engine is not None:
            try:
                engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
            except UnsupportedModelError:
                pass
            finally:
                assert not engine.has_unfinished(), "the request was left in the engine"
                engine.close()


# ---- models ------------------------------------------------------------------------------
def test_model_load_errors(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        model_config("gpt-9")
    assert_words(info.value, ["'gpt-9'", "tiny-llama, tiny-qwen2, small-llama"])
    with pytest.raises(ModelLoadError) as info:
        build_model("gpt-9")
    assert_words(info.value, ["'gpt-9'", "tiny-llama"])
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(ModelLoadError) as info:
        load_model(missing)
    assert_words(info.value, [repr(missing), "tiny-llama", "local checkpoint directory"])
    assert issubclass(ModelLoadError, ValueError) and issubclass(ModelLoadError, RuntimeKVError)


def test_a_directory_that_is_no_checkpoint_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path))
