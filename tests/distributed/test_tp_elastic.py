"""Elastic memory under tensor parallelism (CPU, gloo): a resize that preempts, a larger one,
sleep and wake are plans like any step's, so every rank unmaps and maps the same pool pages,
holds nothing while asleep, and the requests finish with TP=1's tokens."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams

from ..engine.conftest import model

KiB = 1024
PROMPTS = [[i + 1, 7, 9, 11] * 5 for i in range(4)]


def run(world: int):
    """Tokens, preemptions, and (TP) every rank's mapped pool pages asleep and at the end."""
    pages = {}
    # per rank: KV bytes per token halve with the KV heads, so the sizes halve too
    with Engine(model("tiny-llama"), cache="vmem", page_bytes=4096, max_batch=4,
                max_context=128, cache_bytes=128 * KiB // world,
                max_cache_bytes=128 * KiB // world, tensor_parallel_size=world,
                preemption="recompute", check_integrity=True) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
               for p in PROMPTS]
        for _ in range(10):
            engine.step()
        engine.resize_cache(32 * KiB // world, preempt=True)   # room for one request
        for _ in range(5):
            engine.step()
        engine.resize_cache(128 * KiB // world)
        engine.step()
        engine.sleep()
        if world > 1:
            pages["asleep"] = [s["mapped_pool_pages"] for s in engine.tp.memory_states()]
        engine.wake()
        while engine.has_unfinished():
            engine.step()
        out = [engine.output(r).outputs[0].token_ids for r in ids]
        preemptions = engine.stats().num_preemptions
        if world > 1:
            states = engine.tp.memory_states()
            pages["end"] = [s["mapped_pool_pages"] for s in states]
            assert states[0]["mapped_extents"] == states[1]["mapped_extents"]
            assert states[0]["placements"] == states[1]["placements"]
    return out, preemptions, pages


def test_resize_sleep_and_wake_under_tp2_give_tp1s_tokens_on_every_ranks_same_pages():
    one, preempted_one, _ = run(1)
    two, preempted_two, pages = run(2)
    assert one == two
    assert preempted_one == preempted_two > 0        # the shrink preempted the same requests
    assert pages["asleep"] == [0, 0]                 # asleep: no rank maps a page
    assert pages["end"][0] == pages["end"][1]
