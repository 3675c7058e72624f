"""Bad input to the engine, the HF integration, model loading and the ``generate``/``bench``
subcommands (docs/errors.md, sections "engine", "HF integration", "models" and the CLI table).

Every case checks the exception type, that the message names the offending value and the
limit / allowed values, and that nothing changed: an engine still has no unfinished requests and
its manager passes ``check_integrity``; a VMemCache's ``stats()``, manager stats and cached K/V
are as before.
"""
import gc
import os
from types import SimpleNamespace

import pytest
import torch

from runtime.cli import main
from runtime.engine import Engine, EngineConfig, SamplingParams
from runtime.engine.errors import EngineConfigError, EngineError, RequestRejectedError
from runtime.errors import CacheConfigError, CacheStateError, CacheTooLargeError, RuntimeKVError
from runtime.attention.errors import UnknownBackendError
from runtime.hf.attention import StepContext, UnsupportedModelError, vmemkv_attention
from runtime.hf.cache import (BatchTooLargeError, CacheCapacityError, ContextOverflowError,
                              VMemCache, cache_config_from_model)
from runtime.models import ModelLoadError, build_model, load_model, model_config
from scheduler.errors import ConfigError

BYTES_PER_TOKEN = 512          # tiny-llama: 2 layers x K,V x 2 kv heads x 16 x fp32


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama")


def engine_state(engine):
    sched = engine.scheduler
    return (engine.has_unfinished(), len(sched.waiting), sorted(sched.seqs), engine._next_request,
            sorted(engine._requests), sorted(engine._samples), engine._prompt_tokens,
            engine.cache.manager.stats())


def assert_words(error, words):
    for word in words:
        assert word in str(error), (word, str(error))


# ---- EngineConfig / SamplingParams -------------------------------------------------------
ENGINE_CONFIG_CASES = [
    ("cache", dict(cache="flat"), ["EngineConfig.cache", "vmem, paged", "'flat'"]),
    ("layout", dict(layout="diagonal"), ["EngineConfig.layout", "per-layer, interleaved", "'diagonal'"]),
    ("preemption", dict(preemption="drop"), ["EngineConfig.preemption", "recompute, swap", "'drop'"]),
    ("block-size", dict(block_size=0), ["EngineConfig.block_size", ">= 1", "0"]),
    ("max-batch", dict(max_batch=0), ["EngineConfig.max_batch", ">= 1", "got 0"]),
    ("max-batch-bool", dict(max_batch=True), ["EngineConfig.max_batch", "got True"]),
    ("max-context", dict(max_context=1), ["EngineConfig.max_context", ">= 2", "got 1"]),
    ("max-tokens-per-step", dict(max_tokens_per_step=0), ["EngineConfig.max_tokens_per_step", ">= 1", "0"]),
    ("step-below-batch", dict(max_batch=8, max_tokens_per_step=4),
     ["max_tokens_per_step", ">= max_batch (8)", "got 4"]),
    ("swap-bytes", dict(swap_bytes=-1), ["EngineConfig.swap_bytes", ">= 0", "-1"]),
    ("swap-without-space", dict(preemption="swap"), ["EngineConfig.swap_bytes", "> 0", "preemption='swap'"]),
    ("seed", dict(seed=-1), ["EngineConfig.seed", ">= 0", "-1"]),
    ("max-plan-retries", dict(max_plan_retries=-1), ["EngineConfig.max_plan_retries", ">= 0", "-1"]),
    ("page-bytes", dict(page_bytes=0), ["EngineConfig.page_bytes", ">= 1 or None", "got 0"]),
    ("cache-bytes", dict(cache_bytes=2.5), ["EngineConfig.cache_bytes", ">= 1 or None", "2.5"]),
    ("watermark", dict(watermark=1.0), ["EngineConfig.watermark", "[0, 1)", "1.0"]),
    ("watermark-type", dict(watermark="high"), ["EngineConfig.watermark", "'high'"]),
]


def _params(cases):
    """pytest params from (id, *values) tuples; pytest.param entries pass through."""
    return [c if hasattr(c, "marks") else pytest.param(*c[1:], id=c[0]) for c in cases]


@pytest.mark.parametrize("fields,words", _params(ENGINE_CONFIG_CASES))
def test_engine_config_error(fields, words):
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(**fields)
    assert isinstance(info.value, (EngineError, RuntimeKVError, ValueError))
    assert_words(info.value, words)


SAMPLING_CASES = [
    ("max-new-tokens", dict(max_new_tokens=0), ["SamplingParams.max_new_tokens", ">= 1", "got 0"]),
    ("max-new-tokens-type", dict(max_new_tokens=2.0), ["SamplingParams.max_new_tokens", "an int", "2.0"]),
    ("temperature", dict(temperature=-0.5), ["SamplingParams.temperature", ">= 0", "-0.5"]),
    ("temperature-nan", dict(temperature=float("nan")), ["SamplingParams.temperature", ">= 0", "nan"]),
    ("top-k", dict(top_k=-1), ["SamplingParams.top_k", "an int >= 0", "-1"]),
    ("top-k-type", dict(top_k=1.5), ["SamplingParams.top_k", "an int >= 0", "1.5"]),
    ("top-p-zero", dict(top_p=0.0), ["SamplingParams.top_p", "(0, 1]", "0.0"]),
    ("top-p-above-one", dict(top_p=1.5), ["SamplingParams.top_p", "(0, 1]", "1.5"]),
    ("n", dict(n=0), ["SamplingParams.n", "an int >= 1", "got 0"]),
    ("seed", dict(seed=1.5), ["SamplingParams.seed", "an int or None", "1.5"]),
    ("temperature-type", dict(temperature="hot"), ["SamplingParams.temperature", "'hot'"]),
    ("stop-token-type", dict(stop_token_ids=("eos",)), ["SamplingParams.stop_token_ids", "'eos'"]),
]


@pytest.mark.parametrize("fields,words", [
    pytest.param(c[1], c[2], id=c[0]) for c in SAMPLING_CASES])
def test_sampling_params_error(fields, words):
    with pytest.raises(EngineConfigError) as info:
        SamplingParams(**fields)
    assert_words(info.value, words)


# ---- Engine construction -----------------------------------------------------------------
def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


ENGINE_BUILD_CASES = [
    ("unknown-option", dict(bogus=1), EngineConfigError, ["unknown engine option", "'bogus'"]),
    ("bad-field-as-option", dict(max_batch=0), EngineConfigError, ["EngineConfig.max_batch", "got 0"]),
    ("unknown-attention", dict(attention="flash9"), UnknownBackendError,
     ["'flash9'", "sdpa", "reference"]),
    ("page-too-small", dict(page_bytes=3), ConfigError, ["page_bytes=3", "needs >= 128"]),
    ("cache-holds-no-group", dict(page_bytes=4096, cache_bytes=100), ConfigError,
     ["cache_bytes=100", "needs >= 16384"]),
    ("paged-cache-larger-than-host", dict(cache="paged", max_batch=1, max_context=1 << 16,
                                          block_size=1 << 16, cache_bytes="2x-host"),
     CacheTooLargeError, ["MemTotal", "bytes", "lower cache_bytes"]),
    ("vmem-cache-larger-than-host", dict(cache="vmem", max_batch=1, max_context=1 << 16,
                                         page_bytes=1 << 26, cache_bytes="2x-host"),
     CacheTooLargeError, ["MemTotal", "bytes", "lower cache_bytes"]),
]


@pytest.mark.parametrize("options,error,words", [pytest.param(*c[1:], id=c[0]) for c in ENGINE_BUILD_CASES])
def test_engine_construction_error(model, options, error, words):
    if options.get("cache_bytes") == "2x-host":
        options = {**options, "cache_bytes": 2 * mem_total()}
        words = words + [str(mem_total())]
    with pytest.raises(error) as info:
        Engine(model, **options)
    assert_words(info.value, words)


def _process_resources():
    gc.collect()
    return open("/proc/self/maps").read().count("\n"), len(os.listdir("/proc/self/fd"))


def test_failed_engine_construction_leaks_nothing(model):
    Engine(model, max_batch=2, max_context=64, page_bytes=4096).close()   # warm lazy state
    maps_before, fds_before = _process_resources()
    for _ in range(10):
        with pytest.raises(UnknownBackendError):
            Engine(model, max_batch=2, max_context=64, page_bytes=4096, attention="flash9")
    maps_after, fds_after = _process_resources()
    assert fds_after == fds_before                    # no memfd left open
    # a leaked reservation would add one mapping per failure (10); unrelated threads and
    # allocator arenas elsewhere in the test process may move the count by one or two
    assert maps_after - maps_before < 5


# ---- add_request / generate --------------------------------------------------------------
@pytest.fixture(params=["vmem", "paged"])
def engine(request, model):
    if request.param == "vmem":
        eng = Engine(model, cache="vmem", page_bytes=4096, max_batch=2, max_context=64)
    else:
        eng = Engine(model, cache="paged", block_size=8, max_batch=2, max_context=64)
    eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))   # one request already queued
    yield eng
    eng.close()


ADD_REQUEST_CASES = [
    ("longer-than-max-context", [1] * 60, SamplingParams(max_new_tokens=5),
     ["prompt 0 rejected", "prompt 60 + max_tokens 5 = 65 tokens", "max_seq_len 64"]),
    ("prompt-alone-too-long", [1] * 65, SamplingParams(max_new_tokens=1),
     ["prompt 65", "66 tokens", "max_seq_len 64"]),
    ("empty", [], None, ["prompt 0 is empty"]),
    ("token-above-vocab", [1, 256, 300], None, ["[256, 300]", "outside the vocabulary [0, 256)"]),
    ("negative-token", [-1, 5], None, ["[-1]", "[0, 256)"]),
    ("text-without-tokenizer", "hello world", None, ["prompt 0 is text", "no tokenizer"]),
]


@pytest.mark.parametrize("prompt,params,words", [pytest.param(*c[1:], id=c[0]) for c in ADD_REQUEST_CASES])
def test_add_request_rejects_and_changes_nothing(engine, prompt, params, words):
    before = engine_state(engine)
    with pytest.raises(RequestRejectedError) as info:
        engine.add_request(prompt, params)
    assert info.value.index == 0
    assert_words(info.value, words)
    assert engine_state(engine) == before
    engine.cache.manager.check_integrity()


def test_a_prompt_that_can_never_fit_the_cache_is_rejected(model):
    # max_context 64, but the whole cache holds 4 blocks of 8 tokens = 32 tokens
    with Engine(model, cache="paged", block_size=8, max_batch=2, max_context=64,
                cache_bytes=4 * 8 * BYTES_PER_TOKEN) as eng:
        before = engine_state(eng)
        with pytest.raises(RequestRejectedError) as info:
            eng.add_request([1] * 30, SamplingParams(max_new_tokens=4), index=3)
        assert info.value.index == 3
        assert_words(info.value, ["prompt 3 rejected", "34 tokens can never fit", "holds 32 tokens"])
        assert engine_state(eng) == before
        with pytest.raises(RequestRejectedError) as info:    # generate checks every prompt first
            eng.generate([[1, 2], [1] * 30], SamplingParams(max_new_tokens=4))
        assert info.value.index == 1
        assert_words(info.value, ["prompt 1 rejected", "30 prompt + 4 new tokens", "the 32 tokens"])
        assert engine_state(eng) == before
        eng.cache.manager.check_integrity()


GENERATE_CASES = [
    ("second-prompt-too-long", ([[1, 2], [1] * 60], SamplingParams(max_new_tokens=5)),
     RequestRejectedError, ["prompt 1 rejected", "60 prompt + 5 new tokens", "64 tokens"]),
    ("second-prompt-bad-token", ([[1, 2], [999]], None), RequestRejectedError,
     ["prompt 1", "[999]", "[0, 256)"]),
    ("second-prompt-text", ([[1, 2], "hi"], None), RequestRejectedError, ["prompt 1 is text", "no tokenizer"]),
    ("one-flat-prompt", ([1, 2, 3], None), EngineConfigError, ["list of prompts"]),
    ("a-string", ("hello", None), EngineConfigError, ["list of prompts"]),
    ("params-count", ([[1], [2]], [SamplingParams()] * 3), EngineConfigError,
     ["got 3 SamplingParams for 2 prompts"]),
]


@pytest.mark.parametrize("args,error,words", [pytest.param(*c[1:], id=c[0]) for c in GENERATE_CASES])
def test_generate_rejects_the_whole_batch_up_front(engine, args, error, words):
    before = engine_state(engine)
    with pytest.raises(error) as info:
        engine.generate(*args)
    assert_words(info.value, words)
    assert engine_state(engine) == before        # nothing queued, nothing ran
    engine.cache.manager.check_integrity()


def test_a_non_numeric_token_is_rejected_as_a_request(model):
    with Engine(model, cache="paged", block_size=8, max_batch=2, max_context=64) as eng:
        with pytest.raises(RequestRejectedError, match="prompt 0"):
            eng.add_request(["a", 2])


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
        self.config = SimpleNamespace(max_context=max_context)
        self.writes = []

    def write(self, *args):
        self.writes.append(args)


def attention_call(batch=1, ctx=True, module=None, **kwargs):
    cache = RecordingCache()
    module = module or SimpleNamespace(layer_idx=1, is_causal=True)
    q = torch.zeros(batch, 4, 3, 16)
    k = torch.zeros(batch, 2, 3, 16)
    if ctx:
        kwargs["vmemkv_step"] = StepContext(cache, backend=None)
    return cache, (lambda: vmemkv_attention(module, q, k, k, None, **kwargs))


UNSUPPORTED_CASES = [
    ("no-step-context", dict(ctx=False), ["vmemkv_step=StepContext", "runtime.engine"]),
    ("batched", dict(batch=2), ["packed batches [1, tokens, ...]", "batch of 2"]),
    ("softcap", dict(softcap=30.0), ["softcapping"]),
    ("sliding-window", dict(sliding_window=16), ["layer 1", "sliding window of 16", "max_context 64"]),
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
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        qwen = AutoModelForCausalLM.from_config(config).eval()
    engine = None
    try:
        with pytest.raises(UnsupportedModelError, match="sliding window of 8"):
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


# ---- CLI: generate and bench -------------------------------------------------------------
def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    except Exception as error:     # an uncaught error is what a user sees as a traceback
        code = f"uncaught {type(error).__name__}: {error}"
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def prompt_files(tmp_path):
    files = {"good": "1 2 3\n", "text": "1 2 3\nhello world\n", "blank": "\n  \n",
             "vocab": "1 300\n", "long": " ".join(["1"] * 20) + "\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_text(text)
    return tmp_path


GENERATE_CLI_CASES = [
    ("unknown-model", ["--model", "gpt-9", "--prompts", "{good}"], ["ModelLoadError", "'gpt-9'", "tiny-llama"]),
    ("missing-prompts", ["--prompts", "{dir}/missing.txt"], ["cannot read prompts", "missing.txt",
                                                              "No such file"]),
    ("text-line-without-tokenizer", ["--prompts", "{text}"], ["prompt line 2", "no tokenizer", "'hello world'"]),
    ("no-prompts", ["--prompts", "{blank}"], ["no prompts in", "blank.txt"]),
    ("token-outside-vocab", ["--prompts", "{vocab}"], ["RequestRejectedError", "[300]", "[0, 256)"]),
    ("prompt-too-long", ["--prompts", "{long}", "--cache", "paged", "--max-context", "16"],
     ["RequestRejectedError", "20 prompt + 16 new tokens", "16 tokens"]),
    ("max-new-tokens", ["--prompts", "{good}", "--max-new-tokens", "0"], ["max_new_tokens", ">= 1", "0"]),
    ("max-new-tokens-not-int", ["--prompts", "{good}", "--max-new-tokens", "abc"],
     ["--max-new-tokens", "invalid int value: 'abc'"]),
    ("temperature", ["--prompts", "{good}", "--temperature", "-1"], ["temperature", ">= 0", "-1.0"]),
    ("top-k", ["--prompts", "{good}", "--top-k", "-1"], ["top_k", ">= 0", "-1"]),
    ("top-p", ["--prompts", "{good}", "--top-p", "0"], ["top_p", "(0, 1]", "0.0"]),
    ("n", ["--prompts", "{good}", "--n", "0"], ["SamplingParams.n", ">= 1", "0"]),
    ("max-batch", ["--prompts", "{good}", "--max-batch", "0"], ["EngineConfig.max_batch", ">= 1", "0"]),
    ("max-context", ["--prompts", "{good}", "--max-context", "1"], ["EngineConfig.max_context", ">= 2", "1"]),
    ("block-size", ["--prompts", "{good}", "--cache", "paged", "--block-size", "0"],
     ["EngineConfig.block_size", ">= 1", "0"]),
    ("swap-without-space", ["--prompts", "{good}", "--preemption", "swap"], ["swap_bytes", "> 0"]),
    ("watermark", ["--prompts", "{good}", "--watermark", "1"], ["watermark", "[0, 1)", "1.0"]),
    ("page-bytes", ["--prompts", "{good}", "--page-bytes", "3"], ["ConfigError", "page_bytes=3", ">= 128"]),
    ("cache-bytes", ["--prompts", "{good}", "--cache-bytes", "100"], ["ConfigError", "cache_bytes=100"]),
    ("attention", ["--prompts", "{good}", "--attention", "flash9"], ["'flash9'", "sdpa"]),
    ("cache-choice", ["--prompts", "{good}", "--cache", "flat"], ["--cache", "invalid choice: 'flat'"]),
    ("dtype-choice", ["--prompts", "{good}", "--dtype", "int8"], ["--dtype", "invalid choice: 'int8'"]),
    ("device-unknown", ["--prompts", "{good}", "--device", "tpu"], ["--device", "'tpu'"]),
    pytest.param("device-cuda-without-gpu", ["--prompts", "{good}", "--device", "cuda"], ["cuda"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
]

BENCH_CLI_CASES = [
    ("only-unknown-section", ["--only", "bogus"], ["--only", "invalid choice: 'bogus'", "alloc"]),
    ("only-nothing", ["--only"], ["--only", "expected at least one argument"]),
    ("threads-zero", ["--threads", "0"], ["--threads must be >= 1", "got 0"]),
    ("threads-negative", ["--threads", "-2"], ["--threads must be >= 1", "got -2"]),
    ("threads-not-int", ["--threads", "x"], ["--threads", "invalid int value: 'x'"]),
    ("device-choice", ["--device", "tpu"], ["--device", "invalid choice: 'tpu'"]),
]


def _cli_params(command, cases):
    out = []
    for case in cases:
        if hasattr(case, "marks"):
            out.append(pytest.param(command, *case.values[1:], id=case.values[0], marks=case.marks))
        else:
            out.append(pytest.param(command, *case[1:], id=case[0]))
    return out


@pytest.mark.parametrize("command,argv,words", _cli_params("generate", GENERATE_CLI_CASES)
                         + _cli_params("bench", BENCH_CLI_CASES))
def test_cli_error_is_one_line_exit_2(command, argv, words, prompt_files, capsys):
    paths = {name: str(prompt_files / f"{name}.txt") for name in ("good", "text", "blank", "vocab", "long")}
    argv = [command] + [a.format(dir=prompt_files, **paths) for a in argv]
    if command == "generate":
        argv.append("--no-progress")
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith(f"vmemkv {command}: error: "), err
    assert "Traceback" not in err and out == ""
    for word in words:
        assert word in err, (word, err)


def test_bench_cuda_without_a_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    code, out, err = run_cli(["bench", "--device", "cuda"], capsys)
    assert code == 2 and out == ""
    assert err == "vmemkv bench: error: --device cuda but torch sees no CUDA GPU\n"
