"""Objects of the wrong kind handed to the lower-level entry points are refused up front, typed
and naming the argument, with nothing built or changed. Before: ``make_kv(driver="host")``,
``Engine(driver="host")`` and ``PagePool("host", ...)`` failed deep inside ("'str' object has
no attribute 'check_bytes'") and ``driver=0`` was read as "no driver"; ``VirtualRange("pool")``,
``make_kv("cfg")`` and ``VMemCache(None)`` were AttributeErrors / TypeErrors; ``page_bytes=0``
or ``{}`` built the default page (EngineConfig refuses 0); ``background_mapper="no"`` turned the
mapper on; ``open_driver("host", "x")`` ignored the index; ``CacheConfig(device=2**63)`` was a
raw ValueError; ``Engine(attention=["sdpa"])`` an unhashable TypeError; ``stats(since={...})``
a KeyError, ``since=np.int64(3)`` an IndexError, ``outputs=[1]`` an AttributeError; ``add_all``
and ``check_admissible(None, ...)`` raw TypeErrors; ``add_lora("a", 3)`` a TypeError about
paths."""
from __future__ import annotations

import numpy as np
import pytest

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.engine import Engine, EngineConfig, EngineConfigError, SamplingParams
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.hf.cache import VMemCache
from vmemkv.runtime.kv import cache_for, default_page_bytes, make_kv
from vmemkv.runtime.lora import LoraConfigError
from vmemkv.runtime.models import build_model
from vmemkv.vmem import PagePool, VirtualRange, VMemConfigError, open_driver

CONFIG = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=4, max_context=256)
OPTIONS = dict(max_batch=4, max_context=64)


@pytest.fixture(scope="module")
def engine():
    with Engine(build_model("tiny-llama", seed=0), **OPTIONS) as built:
        yield built


@pytest.fixture(scope="module")
def host():
    driver = open_driver("host")
    yield driver
    driver.close()


def test_a_driver_name_or_a_falsy_value_is_no_driver_and_is_refused_by_name(host):
    with pytest.raises(CacheConfigError, match=r"^make_kv: driver must be a vmem Driver .*"
                                               r"got str 'host': open it first, "
                                               r"open_driver\('host'\)"):
        make_kv(CONFIG, "vmem", driver="host")
    with pytest.raises(CacheConfigError, match=r"^make_kv: driver must be a vmem Driver .*got int 0"):
        make_kv(CONFIG, "vmem", driver=0)       # was read as "no driver": the default opened
    with pytest.raises(VMemConfigError, match=r"^driver must be a vmem Driver .*got str 'host'"):
        PagePool("host", 4, host.granularity_bytes)
    with make_kv(CONFIG, "vmem", driver=host) as kv:       # a real driver is taken as before
        assert kv.cache.driver is host


def test_an_engine_given_a_driver_name_is_refused_naming_driver_and_takes_no_model():
    lm = build_model("tiny-llama", seed=0)
    before = lm.config._attn_implementation
    with pytest.raises(CacheConfigError, match=r"driver must be a vmem Driver .*open_driver"):
        Engine(lm, driver="host", **OPTIONS)
    assert lm.config._attn_implementation == before     # no engine kept the model


def test_a_config_or_pool_of_the_wrong_kind_is_refused_naming_it(host):
    with pytest.raises(CacheConfigError, match=r"^make_kv needs config, a CacheConfig .*got str"):
        make_kv("cfg")
    with pytest.raises(CacheConfigError, match=r"^VMemCache needs config, a CacheConfig .*"
                                               r"got NoneType None"):
        VMemCache(None)
    with pytest.raises(VMemConfigError, match=r"a virtual range needs pool, a PagePool .*got str"):
        VirtualRange("pool", 1 << 20)
    with pytest.raises(VMemConfigError, match=r"needs pool, a PagePool .*got HostDriver"):
        VirtualRange(host, 1 << 20)


@pytest.mark.parametrize("page_bytes", [0, {}, -65536, True, 65536.0, "65536"])
def test_a_page_size_that_is_no_positive_int_is_refused_not_read_as_the_default(page_bytes):
    with pytest.raises(CacheConfigError, match=r"^make_kv: page_bytes must be an int >= 1 or "
                                               r"None \(the default page\), got"):
        make_kv(CONFIG, "vmem", page_bytes=page_bytes)
    with pytest.raises(CacheConfigError, match=r"^VMemCache: page_bytes must be an int >= 1"):
        VMemCache(CONFIG, page_bytes=page_bytes)


def test_no_page_size_still_builds_the_default_page_and_a_given_one_is_kept():
    default = default_page_bytes(CONFIG, "per-layer")
    with make_kv(CONFIG, "vmem") as kv:
        assert kv.cache.page_bytes == default
    with make_kv(CONFIG, "vmem", page_bytes=2 * default) as kv:
        assert kv.cache.page_bytes == 2 * default


@pytest.mark.parametrize("flag", ["background_mapper", "grow_pages"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_a_cache_flag_that_is_not_a_bool_is_refused_by_name(flag, value):
    with pytest.raises(CacheConfigError, match=rf"^make_kv: {flag} must be True or False, got"):
        make_kv(CONFIG, "vmem", **{flag: value})
    with make_kv(CONFIG, "vmem") as kv:                    # the cache built from the manager
        with pytest.raises(CacheConfigError, match=rf"^cache_from_layout: {flag} must be True"):
            cache_for(kv.manager, CONFIG, **{flag: value})


def test_a_pool_grow_flag_that_is_not_a_bool_is_refused(host):
    with pytest.raises(VMemConfigError, match=r"^grow must be True or False, got str 'no'"):
        PagePool(host, 4, host.granularity_bytes, grow="no")   # was an on-demand pool


@pytest.mark.parametrize("kind, index, message", [
    ("host", "x", r"device_index None or an int >= 0, got 'x'"),
    ("auto", "x", r"device_index None or an int >= 0, got 'x'"),
    ("host", True, r"device_index None or an int >= 0, got True"),
    ("host", -1, r"device_index None or an int >= 0, got -1"),
    ("host", 0, r"open_driver\('host'\) takes no device_index .*got 0")])
def test_open_driver_refuses_a_device_index_it_cannot_use(kind, index, message):
    with pytest.raises(VMemConfigError, match=message):
        open_driver(kind, index)


def test_a_device_index_past_int64_is_a_cache_config_error_naming_device():
    with pytest.raises(CacheConfigError, match=r"^CacheConfig.device must be 'cpu' or "
                                               r"'cuda\[:i\]', got 9223372036854775808"):
        CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, device=2**63)


def test_an_attention_name_that_is_no_str_is_refused_naming_attention():
    with pytest.raises(EngineConfigError, match=r"^EngineConfig.attention must be a backend "
                                                r"name \(str\) or None, got list \['sdpa'\]"):
        EngineConfig(attention=["sdpa"])
    lm = build_model("tiny-llama", seed=0)
    with pytest.raises(EngineConfigError, match=r"EngineConfig.attention"):
        Engine(lm, attention=["sdpa"], **OPTIONS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(since={"x": 1}), r"^stats: since must be None or a StatsMark .*got dict"),
    (dict(since=np.int64(3)), r"^stats: since must be None or a StatsMark .*got int64"),
    (dict(since="mark"), r"^stats: since must be None or a StatsMark .*got str"),
    (dict(outputs=[1]), r"^stats: outputs must be a list of RequestOutput .*got list \[1\]"),
    (dict(outputs="x"), r"^stats: outputs must be a list of RequestOutput .*got str 'x'")])
def test_stats_refuses_a_mark_or_outputs_of_the_wrong_kind(engine, kwargs, message):
    with pytest.raises(EngineConfigError, match=message):
        engine.stats(**kwargs)


def test_stats_since_a_generate_mark_still_counts_that_call(engine):
    before = engine.stats()
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3,
                                                                  ignore_eos=True))
    last = engine.last_stats                   # stats(since=<generate's mark>, outputs=...)
    assert (last.requests, last.prompt_tokens, last.output_tokens) == (2, 5, 6)
    assert engine.stats().requests == before.requests + 2
    assert engine.stats(outputs=tuple(outputs)).requests == before.requests + 2


@pytest.mark.parametrize("add, count, message", [
    (None, 1, r"^add_all: add must be callable, got None"),
    ("x", 1, r"^add_all: add must be callable, got 'x'"),
    (lambda i: 0, "2", r"^add_all: count must be an int >= 0, got str '2'"),
    (lambda i: 0, 2.0, r"^add_all: count must be an int >= 0, got float 2.0"),
    (lambda i: 0, -1, r"^add_all: count must be an int >= 0, got int -1"),
    (lambda i: 0, True, r"^add_all: count must be an int >= 0, got bool True")])
def test_add_all_refuses_a_callback_or_count_of_the_wrong_kind(engine, add, count, message):
    with pytest.raises(EngineConfigError, match=message):
        engine.add_all(add, count)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompts", [None, 3, "abc"])
def test_check_admissible_refuses_what_is_no_batch_of_prompts(engine, prompts):
    with pytest.raises(EngineConfigError, match=r"^prompts must be a list of prompts"):
        engine.check_admissible(prompts, None)


@pytest.mark.parametrize("path", [3, None, b"/tmp", ["/tmp"]])
def test_add_lora_refuses_a_path_that_is_no_path_and_loads_nothing(engine, path):
    with pytest.raises(LoraConfigError, match=r"^add_lora: path must be the adapter's directory "
                                              r"\(a str or os.PathLike\), got"):
        engine.add_lora("a", path)
    assert engine.loras == []


def test_add_lora_refuses_a_replace_that_is_not_a_bool(engine, tmp_path):
    with pytest.raises(EngineConfigError, match=r"^add_lora: replace must be True or False, "
                                                r"got str 'no'"):
        engine.add_lora("a", tmp_path, replace="no")
    assert engine.loras == []
