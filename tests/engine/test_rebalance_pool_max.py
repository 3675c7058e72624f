"""``rebalance_memory`` grows no further than the pool's ``max_cache_bytes`` (whole resize steps
under the share's max: runtime/engine/elastic.py): a grow the share allows past it is made to
the pool's max, not refused whole. Here the share may hold 65.5 KiB and the pool at most 64 KiB
(8 KiB steps); an engine at 56 KiB asks for a grow step (8.2 KiB, grow_fraction of its max)
for its fourth request, which the other three leave no room: a target of 65.5 KiB, past the
pool's ids, refused the resize (CacheResizeError, kept at 56 KiB) and the request waited for the
others to finish."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.scheduler.budget import MemoryBudget

from .conftest import model, tokens

KiB = 1024


def test_rebalance_grows_to_the_pools_max_when_the_share_allows_a_little_more():
    budget = MemoryBudget(256 * KiB, clock=lambda: 0.0)
    engine = Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=56 * KiB,
                    max_cache_bytes=65 * KiB + 512, page_bytes=4096, layout="interleaved",
                    max_context=256, max_batch=4)
    pool = engine.kv.manager
    assert (pool.max_cache_bytes, pool.resize_step_bytes) == (64 * KiB, 8 * KiB)
    assert engine.memory_share.max_bytes == 65 * KiB + 512
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[(i * 7 + j) % 250 + 1 for j in range(30)] for i in range(4)]  # 38 tokens each
    ids = [engine.add_request(p, sp) for p in prompts]
    engine.step()
    assert (len(engine.scheduler.running), len(engine.scheduler.waiting)) == (3, 1)
    engine.step()                              # rebalanced first: grown to the pool's max
    assert engine.cache_bytes == budget.held_bytes == 64 * KiB
    assert (len(engine.scheduler.running), len(engine.scheduler.waiting)) == (4, 0)
    while engine.has_unfinished():
        engine.step()
    assert [len(t) for t in tokens([engine.output(i) for i in ids])] == [8] * 4
    engine.close()
