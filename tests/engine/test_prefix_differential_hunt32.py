"""Hunt 32, prefix caching across requests (docs/usage.md "Prefix caching across requests").

An engine differential driven by hypothesis: multi-turn chats that share system prompts, each
turn arriving a few steps after its previous answer (so turns overlap other chats' prefills
and decodes), some under a cache salt, on a cache small enough that cached units are evicted
and running requests preempted (swap or recompute); tiny-llama (paged, vmem per-layer with
block hits finer than a page, vmem interleaved) and tiny-gemma3 (windowed and full layers).
With ``prefix_sharing=True`` (``off``: running requests share; ``lru``, ``hits``: finished
ones' units stay cached too) every request's greedy tokens must equal those of the same engine
with sharing off, the manager's integrity check holds after every step, and at the end the
cache keeps exactly the tokens ``reset_prefix_cache`` then evicts (paged: every block free).

Then what one tenant can learn of another: chats under different salts, sent one tenant after
the other, hit only their own earlier turns, to the token (paged and vmem count the same).
"""
from __future__ import annotations

import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

MAX_CONTEXT = 64
CACHE_TOKENS = 96            # 3 chats of up to MAX_CONTEXT tokens: evictions and preemptions
CACHES = {   # name -> (model, cache options): block hits finer than a page (vmem per-layer:
             # 32-token pages, 4-token blocks); Gemma 3's five 32-token windows and one full
             # layer (windows pass inside MAX_CONTEXT)
    "paged-4": ("tiny-llama", dict(cache="paged", block_size=4)),
    "vmem-per-layer-blocks-4": ("tiny-llama", dict(cache="vmem", layout="per-layer",
                                                   page_bytes=4096, block_size=4)),
    "vmem-interleaved": ("tiny-llama", dict(cache="vmem", layout="interleaved", page_bytes=4096)),
    "gemma3-paged-4": ("tiny-gemma3", dict(cache="paged", block_size=4)),
    "gemma3-vmem-per-layer-blocks-4": ("tiny-gemma3", dict(cache="vmem", layout="per-layer",
                                                           page_bytes=4096, block_size=4)),
}
TOKEN_BYTES = {"tiny-llama": 512, "tiny-gemma3": 1536}   # K and V of every layer, fp32
ROOMY_BYTES = 384 * 512      # tiny-llama: 12 vmem page groups, room to evict nothing below
ENDED = ("finished", "aborted", "failed")
TOKEN = st.integers(1, 255)
CHAT = st.fixed_dictionaries({
    "system": st.integers(0, 1),                          # which shared system prompt
    "question": st.lists(TOKEN, min_size=1, max_size=8),
    "salt": st.sampled_from([None, None, "tenant-a", "tenant-b"]),
    "new_tokens": st.integers(1, 5),
    "follow_ups": st.lists(st.lists(TOKEN, min_size=1, max_size=4), min_size=0, max_size=2),
    "delays": st.lists(st.integers(0, 3), min_size=3, max_size=3),   # steps before each turn
})
WORKLOAD = st.fixed_dictionaries({
    "systems": st.lists(st.lists(TOKEN, min_size=1, max_size=24), min_size=2, max_size=2),
    "chats": st.lists(CHAT, min_size=2, max_size=4),
    "eviction": st.sampled_from(["off", "lru", "hits"]),
    "preemption": st.sampled_from(["recompute", "swap"]),
})


@functools.lru_cache(maxsize=None)
def tiny_model(name: str = "tiny-llama"):
    return build_model(name, seed=0)


def run_chats(workload: dict, cache: str, sharing: bool) -> tuple:
    """Every turn's (prompt, greedy tokens) by (chat, turn), the engine's end state
    (cached tokens, what reset_prefix_cache evicted, free and total tokens after it), the
    prefix hits and the preemptions of the whole run."""
    swap = dict(swap_bytes=256 * 1024) if workload["preemption"] == "swap" else {}
    share = dict(prefix_sharing=True, prefix_eviction=workload["eviction"]) if sharing else {}
    chats = workload["chats"]
    prompts = [workload["systems"][c["system"]] + c["question"] for c in chats]
    turn, rid, wait = [0] * len(chats), [None] * len(chats), [c["delays"][0] for c in chats]
    done = {}
    name, options = CACHES[cache]
    with Engine(tiny_model(name), max_batch=3, max_context=MAX_CONTEXT,
                cache_bytes=CACHE_TOKENS * TOKEN_BYTES[name], preemption=workload["preemption"],
                check_integrity=True, self_check=False, **options, **swap, **share) as engine:
        while True:
            for i, chat in enumerate(chats):
                if rid[i] is not None or turn[i] > len(chat["follow_ups"]):
                    continue
                if wait[i]:
                    wait[i] -= 1
                    continue
                params = SamplingParams(max_new_tokens=chat["new_tokens"], ignore_eos=True,
                                        cache_salt=chat["salt"])
                rid[i] = engine.add_request(prompts[i], params)
            if all(t > len(c["follow_ups"]) for t, c in zip(turn, chats)):
                break
            if engine.has_unfinished():     # (else only the chats' waits run down)
                engine.step()
            for i, chat in enumerate(chats):
                if rid[i] is None or engine.status(rid[i]) not in ENDED:
                    continue
                out = engine.output(rid[i], pop=True)
                assert out.status == "finished", (out.status, out.error)
                tokens = out.outputs[0].token_ids
                done[i, turn[i]] = (tuple(prompts[i]), tuple(tokens))
                rid[i] = None
                if turn[i] < len(chat["follow_ups"]):
                    prompts[i] = prompts[i] + tokens + chat["follow_ups"][turn[i]]
                    wait[i] = chat["delays"][turn[i] + 1]
                turn[i] += 1
        mgr = engine.kv.manager
        cached = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        assert cached == mgr.cached_tokens
        evicted = engine.reset_prefix_cache()
        stats = mgr.stats()
        end = (cached, evicted, mgr.cached_tokens, stats.free_tokens, stats.total_tokens)
        hits = engine.scheduler.gauges()["prefix_cache_hits"]
        preemptions = engine.scheduler.metrics.num_preemptions
    return done, end, hits, preemptions


def check_differential(workload: dict, cache: str) -> tuple:
    """Greedy tokens equal with sharing off and on; at the end the cache holds exactly what
    reset_prefix_cache evicts (paged: then every block is free). (hits, preemptions) on."""
    off, end_off, hits_off, _ = run_chats(workload, cache, sharing=False)
    on, end_on, hits, preemptions = run_chats(workload, cache, sharing=True)
    assert on == off
    assert hits_off == 0 and end_off[:3] == (0, 0, 0)
    cached, evicted, after, free, total = end_on
    assert evicted == cached and after == 0
    if "paged" in cache:               # (vmem: free counts unmapped groups only; the rest
        assert free == total           #  stay mapped under freed slots, reclaimable)
    return hits, preemptions


def seeded_workload(seed: int, eviction: str, preemption: str) -> dict:
    """A WORKLOAD of four chats with two follow-ups each, drawn from ``seed``."""
    rng = random.Random(seed)

    def ids(count):
        return [rng.randrange(1, 256) for _ in range(count)]
    systems = [ids(rng.randint(16, 24)), ids(rng.randint(8, 24))]
    chats = [{"system": rng.randint(0, 1), "question": ids(rng.randint(1, 8)),
              "salt": rng.choice([None, None, "tenant-a", "tenant-b"]),
              "new_tokens": rng.randint(3, 5),
              "follow_ups": [ids(rng.randint(1, 4)) for _ in range(2)],
              "delays": [rng.randint(0, 3) for _ in range(3)]} for _ in range(4)]
    return {"systems": systems, "chats": chats,
            "eviction": eviction, "preemption": preemption}


@pytest.mark.parametrize("cache", list(CACHES))
def test_prefix_sharing_keeps_greedy_tokens_under_eviction_and_preemption(cache):
    """Two committed workloads: between them every cache hits and preempts (swap,
    recompute) with sharing on."""
    hits_swap, swapped = check_differential(seeded_workload(0, "lru", "swap"), cache)
    hits_recompute, recomputed = check_differential(seeded_workload(3, "hits", "recompute"),
                                                    cache)
    assert hits_swap + hits_recompute > 0 and swapped + recomputed > 0


@pytest.mark.parametrize("cache", list(CACHES))
@settings(max_examples=3, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workload=WORKLOAD)
def test_prefix_sharing_never_changes_a_greedy_token(cache, workload):
    check_differential(workload, cache)


def tenant_turns(cache: str, salts: list) -> list:
    """Three chats sharing one 21-token system prompt, sent one after another (each alone in
    its ``generate``), then each one's second turn (its first prompt, 8-token answer and one
    more token) the same way: the prefix hits of each of those six calls."""
    system = list(range(100, 121))
    chats = [system + [7, 8, 9], system + [17], system + [27, 28]]
    hits = []
    with Engine(tiny_model(), max_batch=3, max_context=MAX_CONTEXT, cache_bytes=ROOMY_BYTES,
                check_integrity=True, self_check=False, prefix_sharing=True,
                **CACHES[cache][1]) as engine:
        for turn in range(2):
            for i, salt in enumerate(salts):
                params = SamplingParams(max_new_tokens=8, ignore_eos=True, cache_salt=salt)
                out = engine.generate([chats[i]], params)
                hits.append(engine.last_stats.prefix_cache_hits)
                chats[i] = chats[i] + out[0].outputs[0].token_ids + [5]
    return hits


@pytest.mark.parametrize("cache", ["paged-4", "vmem-per-layer-blocks-4"])
def test_a_tenant_under_another_salt_hits_only_its_own_turns(cache):
    # first turns: 24, 22 and 23 tokens; their computed tokens (+7 of the 8 sampled) fill 7
    # 4-token units each, generated tokens included; each second turn (+9 tokens) hits them all
    assert tenant_turns(cache, ["a", "b", "c"]) == [0, 0, 0, 28, 28, 28]
    # one salt: the later chats' first turns hit the first chat's 20-token system prefix
    assert tenant_turns(cache, ["a", "a", "a"]) == [0, 20, 20, 28, 28, 28]
