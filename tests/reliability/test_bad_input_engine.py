"""Bad input to the engine: EngineConfig, SamplingParams, construction, add_request and
generate (docs/errors.md, section "engine"; HF/models and CLI cases are in the sibling files).

Every case checks the exception type, that the message names the offending value and the
limit / allowed values, and that nothing changed: an engine still has no unfinished requests and
its manager passes ``check_integrity``; a VMemCache's ``stats()``, manager stats and cached K/V
are as before.
"""

import numpy as np
import pytest
import torch

from vmemkv.runtime.engine import Engine, EngineConfig, SamplingParams
from vmemkv.runtime.engine.errors import EngineConfigError, EngineError, RequestRejectedError
from vmemkv.runtime.errors import CacheTooLargeError, RuntimeKVError
from vmemkv.runtime.attention.errors import UnknownBackendError
from vmemkv.scheduler.errors import ConfigError

from .. import process_resources
from ..vmem_only_options import options_for
from .conftest import assert_words, mem_total

BYTES_PER_TOKEN = 512          # tiny-llama: 2 layers x K,V x 2 kv heads x 16 x fp32


def engine_state(engine):
    sched = engine.scheduler
    return (engine.has_unfinished(), len(sched.waiting), sorted(sched.seqs), engine._next_request,
            sorted(engine._requests), sorted(engine._samples), engine._prompt_tokens,
            engine.cache.manager.stats())



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
    ("top-k", dict(top_k=-2), ["SamplingParams.top_k", "an int >= 0", "-2"]),
    ("top-k-type", dict(top_k=1.5), ["SamplingParams.top_k", "an int >= 0", "1.5"]),
    ("top-p-zero", dict(top_p=0.0), ["SamplingParams.top_p", "(0, 1]", "0.0"]),
    ("top-p-above-one", dict(top_p=1.5), ["SamplingParams.top_p", "(0, 1]", "1.5"]),
    ("n", dict(n=0), ["SamplingParams.n", "an int in [1, 1024]", "got 0"]),
    ("n-huge", dict(n=10**20), ["SamplingParams.n", "an int in [1, 1024]", "got 100000000000000000000"]),
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


def test_failed_engine_construction_leaks_nothing(model):
    Engine(model, max_batch=2, max_context=64, page_bytes=4096).close()   # warm lazy state
    with process_resources.watch() as watch:
        before = watch.snapshot()
        for _ in range(10):
            with pytest.raises(UnknownBackendError):
                Engine(model, max_batch=2, max_context=64, page_bytes=4096, attention="flash9")
        # no memfd open or mapped, no reservation left, whether or not construction got that far
        assert watch.snapshot() == before



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
     ["prompt 0 rejected", "60 prompt + 5 new tokens = 65 tokens", "max_seq_len 64"]),
    ("prompt-alone-too-long", [1] * 65, SamplingParams(max_new_tokens=1),
     ["65 prompt", "66 tokens", "max_seq_len 64"]),
    ("empty", [], None, ["prompt 0 is empty"]),
    ("token-above-vocab", [1, 256, 300], None, ["[256, 300]", "outside the vocabulary [0, 256)"]),
    ("negative-token", [-1, 5], None, ["[-1]", "[0, 256)"]),
    ("text-without-tokenizer", "hello world", None, ["prompt 0 is text", "no tokenizer"]),
    ("bytes", b"abc", None, ["got a bytes", "not token ids"]),
    ("dict", {1: 2, 3: 4}, None, ["got a dict", "its keys"]),
    ("generator", (t for t in [1, 2]), None, ["got a generator"]),
    ("numpy-2d", np.array([[1, 2], [3, 4]]), None, ["numpy array of shape (2, 2)", "batch of prompts"]),
    ("numpy-int-in-list", [np.int64(3)], None, ["got int64"]),
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
        assert_words(info.value, ["prompt 1 rejected", "30 prompt + 4 new tokens", "holds 32 tokens"])
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
    ("tensor-prompts", (torch.tensor([[1, 2, 3]]),), EngineConfigError,
     ["list of prompts", "tensor of shape (1, 3)", "prompts.tolist()"]),
    ("tensor-prompt", ([torch.tensor([1, 2, 3])],), RequestRejectedError,
     ["prompt 0", "list of int token ids", "prompt.tolist()"]),
    ("generator-of-prompts", ((p for p in [[1, 2]]),), EngineConfigError,
     ["list of prompts", "got a generator", "list(prompts)"]),
    ("numpy-batch", (np.array([[1, 2], [3, 4]]),), EngineConfigError,
     ["list of prompts", "numpy array of shape (2, 2)", "prompts.tolist()"]),
    ("sampling-string", ([[1, 2, 3]], "greedy"), EngineConfigError,
     ["SamplingParams or a list of them", "str 'greedy'", "SamplingParams(temperature=0)"]),
    ("sampling-list-of-strings", ([[1, 2, 3]], ["greedy"]), EngineConfigError,
     ["SamplingParams or a list of them", "list"]),
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


def test_backend_that_cannot_run_the_model_is_refused_before_any_memory(model, monkeypatch):
    """As on a GPU machine where flash is available: it runs on CUDA only, and has no fp32
    kernel. Both are refused at construction with the values named, not at the first step."""
    from vmemkv.runtime.attention import UnsupportedError
    from vmemkv.runtime.attention.base import Availability
    from vmemkv.runtime.attention.flash import FlashBackend
    monkeypatch.setattr(FlashBackend, "available", classmethod(lambda cls: Availability(True)))
    with pytest.raises(UnsupportedError) as info:
        Engine(model, attention="flash")
    assert_words(info.value, ["'flash'", "['cuda']", "'cpu'"])
    monkeypatch.setattr(FlashBackend, "devices", frozenset({"cpu", "cuda"}))
    with pytest.raises(UnsupportedError) as info:
        Engine(model, attention="flash")
    assert_words(info.value, ["'flash'", "torch.float16", "the model is torch.float32"])


# ---- what is passed to Engine(...) and generate(...) (issue 11 §4) ------------------------
CONSTRUCTOR_ARGUMENT_CASES = [
    ("model-none", lambda m: Engine(None), ["torch causal-LM module", "NoneType", "'None'"]),
    ("model-name", lambda m: Engine("tiny-llama"),
     ["torch causal-LM module", "'tiny-llama'", "build_model('tiny-llama')"]),
    ("config-dict", lambda m: Engine(m, config={"max_batch": 2}),
     ["must be an EngineConfig", "dict", "'max_batch': 2", "Engine(model, **options)"]),
]


@pytest.mark.parametrize("build,words", [pytest.param(*c[1:], id=c[0]) for c in CONSTRUCTOR_ARGUMENT_CASES])
def test_wrong_engine_arguments_are_typed_errors_naming_the_value(model, build, words):
    with pytest.raises(EngineConfigError) as info:
        build(model)
    assert_words(info.value, words)


# ---- the user's max_context is the limit (issue 11 §2) ------------------------------------
@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_max_context_is_the_users_value_not_the_page_rounded_one(model, cache):
    # default host pages hold 512 tokens of tiny-llama's per-layer K: vmem slots are 512 long
    with Engine(model, cache=cache, max_batch=2, max_context=64) as eng:
        before = engine_state(eng)
        with pytest.raises(RequestRejectedError) as info:
            eng.generate([[1] * 200], SamplingParams(max_new_tokens=1))
        assert_words(info.value, ["200 prompt + 1 new tokens", "64 tokens"])
        assert "512" not in str(info.value)
        with pytest.raises(RequestRejectedError) as info:
            eng.add_request([1] * 60, SamplingParams(max_new_tokens=5))
        assert_words(info.value, ["65 tokens", "max_seq_len 64"])
        assert engine_state(eng) == before
        out = eng.generate([[1] * 60], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4            # exactly 64 tokens fits


# ---- memory sizing against what is available (issue 11 §2) -------------------------------
def test_a_budget_far_above_the_host_is_refused_with_the_numbers_before_any_page(model):
    from vmemkv.vmem.faults import FaultInjectingDriver
    from vmemkv.vmem.host import HostDriver
    driver = FaultInjectingDriver(HostDriver())
    with pytest.raises(CacheTooLargeError) as info:
        Engine(model, cache_bytes=10**15, driver=driver)
    assert isinstance(info.value, MemoryError) and str(info.value)
    assert_words(info.value, ["cache_bytes=1000000000000000", "1000000000000000 bytes",
                              "MemTotal", str(mem_total())])
    assert driver.calls["create_pages"] == 0 and driver.calls["reserve"] == 0


@pytest.fixture
def available_40k(monkeypatch):
    """Pretend the host has 40,000 bytes available (its total is untouched)."""
    from vmemkv.runtime import memory
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 40_000)


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_a_budget_above_available_memory_is_refused_though_below_total(model, available_40k, cache):
    # 2 slots x 64 tokens x 512 bytes = 65536 bytes: below MemTotal, above "available"
    with pytest.raises(CacheTooLargeError) as info:
        Engine(model, cache=cache, max_batch=2, max_context=64,
               **options_for(cache, page_bytes=4096))
    assert_words(info.value, ["65536 bytes", "MemAvailable", "40000 bytes", "cache_bytes"])


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_memory_utilization_sizes_the_cache_from_available_memory(model, monkeypatch, cache):
    from vmemkv.runtime import memory
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 1 << 20)
    with Engine(model, cache=cache, max_batch=2, max_context=64, block_size=8,
                memory_utilization=0.25, max_tokens_per_step=2,
                **options_for(cache, page_bytes=4096)) as eng:   # its
        # logits (max_tokens_per_step + max_batch rows) must fit beside the cache too
        budget = eng.stats().cache_bytes
        assert (1 << 18) - 16 * 1024 < budget <= 1 << 18      # a quarter, whole groups / blocks
        eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))


def test_add_request_arguments_of_the_wrong_type_are_refused_and_change_nothing(engine):
    """A dict for the SamplingParams was an AttributeError; a non-callable on_token was
    accepted and then raised out of every step."""
    before = engine_state(engine)
    for args, words in ((([1, 2], {"max_new_tokens": 4}), ["sampling must be a SamplingParams",
                                                          "dict"]),
                        (([1, 2], None, 5), ["on_token must be callable", "5"])):
        with pytest.raises(EngineConfigError) as info:
            engine.add_request(*args)
        assert_words(info.value, words)
        assert engine_state(engine) == before


def test_generate_cli_refuses_a_cache_far_above_the_host(tmp_path, capsys):
    from vmemkv.cli import main
    prompts = tmp_path / "p.txt"
    prompts.write_text("1 2 3\n")
    try:
        code = main(["generate", "--prompts", str(prompts), "--cache-bytes", "100000000000000"])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert_words(err, ["CacheTooLargeError", "100000000000000 bytes", "MemTotal"])


def test_add_request_after_close_is_a_typed_error_and_queues_nothing(model):
    from vmemkv.runtime.engine.errors import EngineClosedError
    eng = Engine(model, cache="vmem", page_bytes=4096, max_batch=2, max_context=64)
    eng.close()
    with pytest.raises(EngineClosedError, match="after close"):
        eng.add_request([1, 2, 3])
    assert not eng.has_unfinished()


def test_a_paged_cache_past_ulimit_v_is_refused_before_anything_is_allocated(model):
    """``ulimit -v`` (RLIMIT_AS) left 1 GiB of address space: a 4 GiB paged cache is a
    CacheTooLargeError naming the limit, not torch's RuntimeError from the allocator."""
    import resource
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, hard))
    try:
        with pytest.raises(CacheTooLargeError, match="ulimit -v"):
            Engine(model, cache="paged", block_size=8, max_batch=2, max_context=64,
                   cache_bytes=4 * 2**30)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
