"""Multi-LoRA serving in the engine: per-request adapters in mixed batches, their weights in
the KV cache's own pool, prefix keys that follow the adapter's content (issue 31).

The reference for each adapter is PEFT's merged model (``merge_and_unload``) run by
transformers' greedy ``generate``; the base model's rows are the plain model's."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

peft = pytest.importorskip("peft")

from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.engine.errors import EngineConfigError, RequestRejectedError  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

from .conftest import prompts, tokens  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, rslora, seed)
ADAPTERS = {"a4": (4, 8, ATTENTION, False, 1), "b8": (8, 16, ATTENTION + MLP, True, 2),
            "c16": (16, 8, ["q_proj", "v_proj", "down_proj"], False, 3)}
CACHES = {"vmem": dict(cache="vmem", layout="per-layer", page_bytes=4096),
          "vmem-interleaved": dict(cache="vmem", layout="interleaved", page_bytes=4096),
          "paged": dict(cache="paged", block_size=4)}


@functools.lru_cache(maxsize=None)
def base(family: str):
    return build_model(family, seed=0)


def make_adapter(family: str, folder, rank: int, alpha: int, targets, rslora: bool,
                 seed: int) -> str:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             use_rslora=rslora, init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(base(family)), config).save_pretrained(str(folder))
    return str(folder)


@functools.lru_cache(maxsize=None)
def merged(family: str, path: str):
    return peft.PeftModel.from_pretrained(copy.deepcopy(base(family)), path).merge_and_unload()


def greedy(model, prompt, max_new_tokens: int) -> list:
    ids = torch.tensor([prompt])   # an explicit mask: token 0 is a prompt token here, not padding
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {(family, name): make_adapter(family, root / f"{family}-{name}", *spec)
            for family in ("tiny-llama", "tiny-qwen2") for name, spec in ADAPTERS.items()}


def run_mixed(family, adapter_dirs, cache: str, new_tokens: int = 8, **options):
    """Eight prompts cycling base, a4, b8, c16 through one engine; returns (ours, reference)."""
    batch = prompts(8, 3, 30, seed=11)
    names = [None, "a4", "b8", "c16"] * 2
    with Engine(build_model(family, seed=0), max_batch=8, max_context=128, **CACHES[cache],
                check_integrity=True, **options) as engine:
        for name in ADAPTERS:
            engine.add_lora(name, adapter_dirs[(family, name)])
        out = engine.generate(batch, [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                                     lora=n)
                                      for n in names])
        stats = engine.kv.manager.adapter_stats()
        last = engine.last_stats
        assert (last.lora_adapter_loads, last.lora_adapter_pages) == (stats.loads, stats.pages)
        preemptions = engine.scheduler.metrics.num_preemptions
    reference = [greedy(base(family) if n is None else merged(family, adapter_dirs[(family, n)]),
                        p, new_tokens) for p, n in zip(batch, names)]
    return tokens(out), reference, stats, preemptions


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_mixed_adapters_match_peft_merged_models(family, cache, adapter_dirs):
    ours, reference, stats, _ = run_mixed(family, adapter_dirs, cache)
    assert ours == reference
    assert stats.loads >= 3          # every adapter went into the pool
    assert stats.pages > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_mixed_adapters_under_preemption(cache, mode, adapter_dirs):
    # the three adapters take 130 KiB while they run, 8 sequences of up to 70 tokens 35 KiB
    # each (512 bytes a token): sequences are preempted and idle adapters give KV their pages
    cache_bytes, new_tokens = 160 * 1024, 40
    ours, reference, stats, preemptions = run_mixed(
        "tiny-llama", adapter_dirs, cache, new_tokens, cache_bytes=cache_bytes, preemption=mode,
        swap_bytes=1 << 20 if mode == "swap" else 0)
    assert ours == reference
    assert stats.evictions > 0 and stats.loads > 3   # evicted for KV, loaded again on demand
    assert preemptions > 0


def test_unknown_adapter_is_refused_before_anything_runs(adapter_dirs):
    with Engine(build_model("tiny-llama", seed=0), max_batch=2, max_context=64) as engine:
        engine.add_lora("a4", adapter_dirs[("tiny-llama", "a4")])
        with pytest.raises(RequestRejectedError, match="lora.*'nope'") as info:
            engine.generate([[1, 2], [3, 4]], [SamplingParams(lora="a4"),
                                               SamplingParams(lora="nope")])
        assert info.value.field == "lora"     # the server's 400 names "model", not "prompt"
        assert not engine.has_unfinished()
        with pytest.raises(EngineConfigError, match="replace=True"):
            engine.add_lora("a4", adapter_dirs[("tiny-llama", "b8")])
        with pytest.raises(EngineConfigError, match="no adapter named 'zz'"):
            engine.remove_lora("zz")
        assert engine.loras == ["a4"]


def test_reloaded_name_never_hits_the_old_weights_kv(adapter_dirs):
    """Same name, other weights: the prefix cache must miss (keys carry the content digest)."""
    prompt = prompts(1, 24, 24, seed=5)[0]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, lora="x")
    with Engine(build_model("tiny-llama", seed=0), max_batch=2, max_context=64, cache="paged",
                block_size=4, prefix_sharing=True, cache_bytes=256 * 1024) as engine:
        engine.add_lora("x", adapter_dirs[("tiny-llama", "a4")])
        first = tokens(engine.generate([prompt], params))
        hits = engine.scheduler.gauges()["prefix_cache_hits"]
        assert tokens(engine.generate([prompt], params)) == first     # same weights: a hit
        assert engine.scheduler.gauges()["prefix_cache_hits"] > hits
        engine.add_lora("x", adapter_dirs[("tiny-llama", "b8")], replace=True)
        hits = engine.scheduler.gauges()["prefix_cache_hits"]
        again = tokens(engine.generate([prompt], params))
        assert engine.scheduler.gauges()["prefix_cache_hits"] == hits   # no hit on old KV
        base_hits = engine.scheduler.gauges()["prefix_cache_hits"]
        engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert engine.scheduler.gauges()["prefix_cache_hits"] == base_hits  # base never shares
    assert again == [greedy(merged("tiny-llama", adapter_dirs[("tiny-llama", "b8")]), prompt, 4)]


def test_idle_adapter_pages_go_to_kv_and_come_back(adapter_dirs):
    """A pool too small for an adapter and a long request at once: the idle adapter is
    evicted for KV, then loaded again on demand; tokens stay exact."""
    family = "tiny-llama"
    path = adapter_dirs[(family, "b8")]
    with Engine(build_model(family, seed=0), max_batch=1, max_context=256, cache="vmem",
                layout="per-layer", page_bytes=4096, cache_bytes=96 * 1024,
                check_integrity=True) as engine:
        engine.add_lora("b8", path)
        manager = engine.kv.manager
        adapter_pages = manager.adapter_pages(manager_bytes(engine, "b8"))
        short = prompts(1, 4, 4, seed=6)[0]
        first = tokens(engine.generate([short], SamplingParams(max_new_tokens=4, ignore_eos=True,
                                                                lora="b8")))
        assert manager.adapter_stats().resident == 1            # idle, still resident
        assert manager.ledger.free_pages + adapter_pages <= manager.capacity_pages
        long = prompts(1, 100, 100, seed=7)[0]   # 140 tokens: 70 of the pool's 96 KiB
        engine.generate([long], SamplingParams(max_new_tokens=40, ignore_eos=True))
        stats = manager.adapter_stats()
        assert stats.evictions >= 1 and stats.resident == 0      # its pages held KV
        again = tokens(engine.generate([short], SamplingParams(max_new_tokens=4,
                                                                ignore_eos=True, lora="b8")))
        assert manager.adapter_stats().loads == 2
    assert again == first == [greedy(merged(family, path), short, 4)]


def manager_bytes(engine, name: str) -> int:
    return engine.adapters.ref(name).num_bytes


def test_replacing_or_removing_an_adapter_lets_running_requests_finish_on_their_weights(
        adapter_dirs):
    family, prompt = "tiny-llama", prompts(1, 12, 12, seed=8)[0]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, lora="x")
    old, new = adapter_dirs[(family, "a4")], adapter_dirs[(family, "c16")]
    with Engine(build_model(family, seed=0), max_batch=4, max_context=64, cache="vmem",
                page_bytes=4096, cache_bytes=512 * 1024, check_integrity=True) as engine:
        engine.add_lora("x", old)
        first = engine.add_request(prompt, params)
        engine.step()                                   # running on the old weights
        engine.add_lora("x", new, replace=True)
        second = engine.add_request(prompt, params)     # the new weights
        engine.step()
        engine.remove_lora("x")                         # both still finish on theirs
        engine.run_until_done()
        got = [engine.output(r, pop=True).outputs[0].token_ids for r in (first, second)]
        engine.step()                                   # an idle step collects
        assert not engine.adapters and engine.loras == []   # no host copy left behind
    assert got == [greedy(merged(family, old), prompt, 6), greedy(merged(family, new), prompt, 6)]


def test_a_memory_budget_grows_an_idle_shrunk_pool_for_an_adapters_pages(adapter_dirs):
    """A pool its MemoryBudget shrank while idle (256 KiB -> 32 KiB) gets a request whose
    tokens fit there but not beside its adapter's 64 KiB: the budget grows the pool for both
    and the tokens are exact. On main the budget asked only for the tokens, so the request
    waited for its adapter's pages for ever (each step ran nothing)."""
    from vmemkv.scheduler.budget import MemoryBudget
    family, clock = "tiny-llama", [0.0]
    path = adapter_dirs[(family, "b8")]
    budget = MemoryBudget(512 * 1024, idle_release_s=1.0, clock=lambda: clock[0])
    prompt = prompts(1, 59, 59, seed=9)[0]
    with Engine(build_model(family, seed=0), memory_budget=budget, cache_bytes=256 * 1024,
                min_cache_bytes=32 * 1024, max_batch=4, max_context=128, cache="vmem",
                layout="per-layer", page_bytes=4096, check_integrity=True) as engine:
        engine.add_lora("b8", path)
        engine.rebalance_memory()       # idle from now
        clock[0] += 5.0
        engine.rebalance_memory()       # idle past idle_release_s: down to its minimum
        assert engine.cache_bytes == 32 * 1024 < 59 * 512 + manager_bytes(engine, "b8")
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                        lora="b8"))
        for _ in range(100):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished(), f"stuck at {engine.cache_bytes} bytes"
        assert engine.cache_bytes >= 99 * 512 + manager_bytes(engine, "b8")
        got = engine.output(rid, pop=True).outputs[0].token_ids
    assert got == greedy(merged(family, path), prompt, 40)
