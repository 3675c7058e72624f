"""The public API's arguments checked by name: a paged engine's ``committed_bytes`` is its block
pool's bytes (it raised AttributeError); a paged ``block_size`` longer than ``max_context`` is
refused by ``EngineConfig`` by the rule the CLI uses (it was blamed on cache_bytes or
CacheConfig.max_context, or accepted); ``build_model`` / ``load_model`` refuse a bad name, seed,
dtype or device before anything is built (they were raw errors, or seed 2.5 was seed 2)."""
from __future__ import annotations

import pytest
import torch

from vmemkv import Engine, SamplingParams
from vmemkv.cli import build_parser
from vmemkv.runtime import generate_checks
from vmemkv.runtime.engine import EngineConfig, EngineConfigError
from vmemkv.runtime.generate_io import GenerateUsageError
from vmemkv.runtime.models import ModelLoadError, build_model, load_model

from .conftest import model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_paged_engines_committed_bytes_are_its_whole_block_pool(name):
    with Engine(model(name), cache="paged", max_batch=2, max_context=64, block_size=16,
                cache_bytes=100_000) as engine:
        layout, config = engine.kv.manager.layout(), engine.cache_config
        group_layers = len(layout.block_groups[0]) if layout.block_groups else config.num_layers
        block_bytes = 16 * config.bytes_per_token * group_layers // config.num_layers
        pool_bytes = layout.num_blocks * block_bytes      # 100,000 bytes hold 98,304 of blocks
        assert (engine.committed_bytes, engine.cache_bytes) == (pool_bytes, pool_bytes) == (
            98_304, 98_304)
        assert engine.kv.cache.pools.nbytes == pool_bytes    # what the cache really holds
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
        assert engine.committed_bytes == pool_bytes          # made whole up front: no growth


@pytest.mark.parametrize("extra", [{}, {"cache_bytes": 8 << 20}], ids=["no-cache-bytes", "cache-bytes"])
@pytest.mark.parametrize("block_size", [129, 1000, 2**30, 2**63])
def test_a_paged_block_longer_than_max_context_is_refused_naming_both(block_size, extra):
    words = (f"EngineConfig.block_size {block_size} tokens is longer than max_context 128: a "
             f"block holds at most one sequence's tokens")
    with pytest.raises(EngineConfigError) as refused:
        EngineConfig(cache="paged", max_context=128, block_size=block_size, **extra)
    assert str(refused.value) == words
    with pytest.raises(EngineConfigError) as refused:
        Engine(model(), cache="paged", max_batch=4, max_context=128, block_size=block_size,
               **extra)
    assert str(refused.value) == words


def test_the_block_rule_is_the_clis_and_lets_a_whole_context_block_and_vmem_through():
    assert EngineConfig(cache="paged", max_context=128, block_size=128).block_size == 128
    assert EngineConfig(cache="vmem", max_context=128, block_size=1000,   # prefix-hit blocks
                        prefix_sharing=True).block_size == 1000
    args = build_parser().parse_args(["generate", "--cache", "paged", "--block-size", "100000"])
    with pytest.raises(GenerateUsageError) as refused:
        generate_checks.check_flags(args)
    assert str(refused.value) == ("--block-size 100000 tokens is longer than --max-context 1024: "
                                  "a block holds at most one sequence's tokens")


@pytest.fixture
def visible_gpus(monkeypatch):
    """Pretend torch sees ``n`` CUDA GPUs (0 on this CPU machine, 1 below)."""
    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    see(0)
    return see


BAD_ARGUMENTS = [
    ("dtype-str", lambda: build_model("tiny-llama", dtype="fp16"),
     ["dtype must be one of torch.float32, torch.float16, torch.bfloat16, torch.float64", "'fp16'"]),
    ("dtype-int", lambda: build_model("tiny-llama", dtype=torch.int8), ["dtype", "torch.int8"]),
    ("dtype-fp8", lambda: build_model("tiny-llama", dtype=torch.float8_e4m3fn),
     ["dtype", "torch.float8_e4m3fn"]),
    ("dtype-none", lambda: build_model("tiny-llama", dtype=None), ["dtype", "None"]),
    ("device-bool", lambda: build_model("tiny-llama", device=True), ["device must be a str", "True"]),
    ("device-float", lambda: build_model("tiny-llama", device=2.5), ["device must be a str", "2.5"]),
    ("device-tpu", lambda: build_model("tiny-llama", device="tpu"),
     ["device must be 'cpu' or 'cuda[:i]'", "'tpu'"]),
    ("device-negative", lambda: build_model("tiny-llama", device=-1), ["device", "-1"]),
    ("device-huge", lambda: build_model("tiny-llama", device=2**63), ["device", str(2**63)]),
    ("device-cuda", lambda: build_model("tiny-llama", device="cuda:5"),
     ["device 'cuda:5' asked for, but no CUDA GPU is visible to torch"]),
    ("device-index", lambda: build_model("tiny-llama", device=0),
     ["device 0 asked for, but no CUDA GPU is visible to torch"]),
    ("seed-float", lambda: build_model("tiny-llama", seed=2.5), ["seed must be an int", "2.5"]),
    ("seed-nan", lambda: build_model("tiny-llama", seed=float("nan")), ["seed", "nan"]),
    ("seed-none", lambda: build_model("tiny-llama", seed=None), ["seed", "None"]),
    ("seed-bool", lambda: build_model("tiny-llama", seed=True), ["seed", "True"]),
    ("seed-negative", lambda: build_model("tiny-llama", seed=-1), ["seed", "[0, 2**64 - 1]", "-1"]),
    ("seed-huge", lambda: build_model("tiny-llama", seed=2**64), ["seed", str(2**64)]),
    ("name-list", lambda: build_model(["tiny-llama"]), ["['tiny-llama']", "built-ins: tiny-llama"]),
    ("load-int", lambda: load_model(0), ["name_or_path", "got 0"]),
    ("load-empty", lambda: load_model(""), ["name_or_path", "got ''"]),
    ("load-dtype", lambda: load_model("tiny-llama", dtype=torch.int8), ["dtype", "or None"]),
    ("load-seed", lambda: load_model("tiny-llama", seed=2.5), ["seed", "2.5"]),
    ("load-device", lambda: load_model("tiny-llama", device="cuda"), ["device 'cuda'"]),
]


@pytest.mark.parametrize("call, words", [c[1:] for c in BAD_ARGUMENTS], ids=[c[0] for c in BAD_ARGUMENTS])
def test_build_and_load_model_refuse_a_bad_argument_by_name(call, words, visible_gpus):
    with pytest.raises(ModelLoadError) as refused:
        call()
    for word in words:
        assert word in str(refused.value), (word, str(refused.value))


def test_a_cuda_device_this_process_does_not_see_is_named(visible_gpus):
    visible_gpus(1)
    for device in ("cuda:5", torch.device("cuda", 1), 1):
        with pytest.raises(ModelLoadError) as refused:
            build_model("tiny-llama", device=device)
        assert f"device {device!r} names a GPU this process does not see: torch sees 1 " \
               f"(cuda:0 to cuda:0)" == str(refused.value)
    with pytest.raises(GenerateUsageError, match="^--device 'cuda:1' names a GPU this process"):
        generate_checks.check_device("cuda:1")     # the CLI's flag, by the same rule


def test_good_arguments_still_build_the_same_weights():
    a = build_model("tiny-llama", seed=2, dtype=torch.bfloat16, device=torch.device("cpu"))
    b, tokenizer = load_model("tiny-llama", seed=2, dtype=torch.bfloat16, device="cpu")
    assert tokenizer is None and next(a.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    build_model("tiny-llama", seed=2**64 - 1)          # torch.manual_seed's largest
