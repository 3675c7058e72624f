"""Sliding-window and hybrid models run requests longer than their cache holds at full length,
exactly: submission counts what each layer kind holds (a windowed kind only what its window
still reads), so tiny-mistral-swa (every layer windowed) and tiny-gemma3 (five windowed layers
to one full) decode past the old whole-length bound with transformers' greedy tokens; vmem
interleaved, which gives nothing back, still refuses past its bound by name."""
from __future__ import annotations

import random

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import RequestRejectedError

from .conftest import hf_greedy, model

KiB = 1024
CACHES = {"per-layer": dict(cache="vmem", layout="per-layer", page_bytes=4 * KiB),
          "interleaved": dict(cache="vmem", layout="interleaved", page_bytes=4 * KiB),
          "paged": dict(cache="paged", block_size=16)}


def prompt(length: int, seed: int = 1) -> list:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def generate(name: str, cache: str, cache_kib: int, batch, new_tokens, max_context=256,
             **options):
    """Tokens per prompt (``new_tokens``: one count, or one per prompt), integrity checked."""
    news = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(batch)
    with Engine(model(name), max_batch=2, max_context=max_context, cache_bytes=cache_kib * KiB,
                check_integrity=True, **CACHES[cache], **options) as engine:
        old = engine.scheduler.max_fit_tokens
        out = engine.generate(batch, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                      for n in news])
        stats = engine.last_stats
    assert [o.status for o in out] == ["finished"] * len(batch)
    return [o.outputs[0].token_ids for o in out], old, stats


@pytest.mark.parametrize("cache", list(CACHES))
def test_mistral_swa_decodes_past_its_whole_length_bound_exactly(cache):
    # 48 KiB hold 96 tokens in every layer; the window gives the rest back on every layout
    p = prompt(20)
    got, old, _ = generate("tiny-mistral-swa", cache, 48, [p], 180)
    assert old == 96
    assert got == hf_greedy("tiny-mistral-swa", [p], 180, ignore_eos=True)


@pytest.mark.parametrize("cache,new,old", [("per-layer", 172, 64), ("paged", 180, 80)])
def test_gemma3_decodes_past_its_whole_length_bound_exactly(cache, new, old):
    # 128 KiB: 64 (per-layer) / 80 (paged) tokens in every layer; the full layer's tokens
    # alone bound it (192 per-layer, beside whole pages of the windowed kind; 256 paged)
    p = prompt(20)
    got, was, _ = generate("tiny-gemma3", cache, 128, [p], new)
    assert was == old
    assert got == hf_greedy("tiny-gemma3", [p], new, ignore_eos=True)


def test_gemma3_on_interleaved_still_refuses_past_its_real_bound():
    # a page holds every layer's slice: nothing goes back behind the window, 85 tokens at most
    p = prompt(20)
    got, old, _ = generate("tiny-gemma3", "interleaved", 128, [p], 65)
    assert old == 85 and got == hf_greedy("tiny-gemma3", [p], 65, ignore_eos=True)
    with pytest.raises(RequestRejectedError, match="20 prompt \\+ 66 new tokens = 86 tokens can "
                                                   "never fit; the cache holds 85 tokens"):
        generate("tiny-gemma3", "interleaved", 128, [p], 66)


@pytest.mark.parametrize("cache,new", [("per-layer", 173), ("paged", 253)])
def test_gemma3_past_its_window_aware_bound_is_refused_by_name(cache, new):
    # paged: 32 blocks; the five windowed groups hold three blocks each, the full one 17: 272
    with pytest.raises(RequestRejectedError, match=f"20 prompt \\+ {new} new tokens = "
                                                   f"{20 + new} tokens can never fit; the cache "
                                                   f"holds {19 + new} tokens of one sequence "
                                                   f"at most after a 20-token prompt"):
        generate("tiny-gemma3", cache, 128, [prompt(20)], new, max_context=512)


@pytest.mark.parametrize("cache", ["per-layer", "paged"])
def test_a_request_past_the_whole_length_bound_stays_exact_under_recompute(cache):
    # the second request, past the whole-length bound, is preempted (recompute) and comes
    # back (tests/scheduler/test_window_fit.py: one preempted past that bound itself)
    batch = [prompt(20, seed=2), prompt(20, seed=3)]
    news = [100, 150]
    got, old, stats = generate("tiny-gemma3", cache, 128, batch, news, preemption="recompute",
                               max_tokens_per_step=64)
    assert stats.num_preemptions > 0 and 20 + news[1] > old
    assert got == [hf_greedy("tiny-gemma3", [p], n, ignore_eos=True)[0]
                   for p, n in zip(batch, news)]
