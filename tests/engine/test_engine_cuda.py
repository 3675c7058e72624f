"""The engine on a GPU (GPU tests, run by benchmarks/gpu_check.sh): real CUDA caches (2 MiB VMM
pages or a device block pool) under an unmodified HF model.

fp32: the fastest backend for fp32 is sdpa (FlashAttention-2 has no fp32 kernel), and greedy
output must equal transformers' own generate on the same GPU up to a near-tie (a different
kernel tiling may flip an argmax whose top-two logits are within 1e-3: tests/engine/near_tie.py). fp16: the flash backend (one
kernel call per layer for batched decode) against the sdpa backend on the same fp16 model; half
precision can flip a near-tie, so most, not all, requests must agree -- a wrong slot, length or
block would make them disagree everywhere.
"""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

from .conftest import prompts, tokens
from .near_tie import hf_greedy_with_margins, near_tie_mismatches
from .test_engine_greedy import CACHES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache", list(CACHES))
def test_fp32_greedy_on_cuda_is_identical_to_transformers_on_cuda(cache):
    batch = prompts(5, 1, 40, seed=1)
    reference = build_model("tiny-llama", seed=0, device="cuda")
    reference.generation_config.eos_token_id = None
    with Engine(build_model("tiny-llama", seed=0, device="cuda"), max_batch=4, max_context=128,
                check_integrity=True, **CACHES[cache]) as engine:
        assert engine.attention == "sdpa" and str(engine.cache.config.torch_device).startswith("cuda")
        out = engine.generate(batch, SamplingParams(max_new_tokens=10, ignore_eos=True))
    reference_tokens, margins = hf_greedy_with_margins(reference, batch, 10)
    assert near_tie_mismatches(tokens(out), reference_tokens, margins) == []


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_fp16_flash_engine_agrees_with_sdpa_engine(cache):
    batch = prompts(8, 4, 60, seed=5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    runs = {}
    for attention in ("flash", "sdpa"):
        model = build_model("small-llama", seed=0, dtype=torch.float16, device="cuda")
        with Engine(model, max_batch=8, max_context=256, cache=cache, attention=attention) as engine:
            runs[attention] = tokens(engine.generate(batch, params))
    agree = sum(a == b for a, b in zip(runs["flash"], runs["sdpa"]))
    assert agree >= 6, f"flash and sdpa agree on {agree} of 8 requests"


def test_elastic_pages_are_created_and_released_on_cuda_and_tokens_survive():
    """Issue 32 on a GPU: a vmem pool of 2 MiB VMM pages shrunk under load (preempting), put to
    sleep (every page's memory released: the pool commits nothing and the device's free memory
    rises by it) and woken; tokens equal the same engine's run without any resize."""
    mib = 2**20
    batch = prompts(4, 8, 40, seed=2)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    opts = dict(max_batch=4, max_context=128, cache_bytes=16 * mib, max_cache_bytes=64 * mib,
                check_integrity=True)
    with Engine(build_model("tiny-llama", seed=0, device="cuda"), **opts) as plain:
        want = tokens(plain.generate(batch, sp))
    with Engine(build_model("tiny-llama", seed=0, device="cuda"), **opts) as engine:
        ids = [engine.add_request(p, sp) for p in batch]
        for _ in range(3):
            engine.step()
        pool = engine.kv.cache.pool
        assert engine.resize_cache(64 * mib) == 64 * mib
        engine.step()
        held = pool.committed_bytes
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        assert engine.sleep() == 64 * mib and pool.committed_bytes == 0
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert freed >= held - 2 * mib, (held, freed)
        engine.wake()
        assert engine.resize_cache(8 * mib, preempt=True) == 8 * mib
        engine.run_until_done()
        got = tokens([engine.output(r, pop=True) for r in ids])
    assert got == want


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_lora_adapters_live_in_cuda_pool_pages_and_match_the_cpu_engine(cache, tmp_path):
    """Issue 31 on a GPU: three adapters and the base model in one batch on a CUDA cache (vmem:
    each adapter's weights in 2 MiB VMM pages of the KV pool, mapped into a range of their
    own); tokens agree with the same engine on the CPU (all but a near-tie flip: fp32 kernels
    tile differently), and the adapters were loaded into the pool."""
    peft = pytest.importorskip("peft")
    import copy
    base = build_model("tiny-llama", seed=0)
    for seed, (name, targets) in enumerate((("a", ["q_proj", "v_proj"]),
                                            ("b", ["o_proj", "down_proj"]),
                                            ("c", ["k_proj", "up_proj"]))):
        torch.manual_seed(seed)
        peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        ).save_pretrained(str(tmp_path / name))
    batch = prompts(8, 4, 40, seed=3)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, lora=n)
              for n in [None, "a", "b", "c"] * 2]
    runs = {}
    for device in ("cpu", "cuda"):
        with Engine(build_model("tiny-llama", seed=0, device=device), max_batch=8,
                    max_context=128, cache=cache, attention="sdpa") as engine:
            for name in "abc":
                engine.add_lora(name, str(tmp_path / name))
            runs[device] = tokens(engine.generate(batch, params))
            assert engine.kv.manager.adapter_stats().loads == 3
    agree = sum(a == b for a, b in zip(runs["cuda"], runs["cpu"]))
    assert agree >= 7, f"CUDA and CPU agree on {agree} of 8 requests"
