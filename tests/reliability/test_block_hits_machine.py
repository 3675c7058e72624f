"""Block-granular prefix hits on vmem (issue 28), through a manager and its host cache: random
admissions that share a donor's prefix cut anywhere, growth, forks, preemption by recompute and
by swap, frees, every written token marked computed (published as it is computed, as the
engine does). After every step the shadow of every token's K/V bytes (tests/reliability/
model.py) equals what the cache holds for every sequence, so no sequence reads a token it did
not compute or hit; every step asserts that no copy and no write lands in a page group another
sequence holds (a shared page is never written). Pages of 32 (per-layer), 16 (interleaved)
and 64 tokens (a group of members spanning 3 pages), blocks of 8.
"""
import random

import pytest

from .model import VOCAB, CacheModel
from .test_cache_state_machines import machine_test

TestBlocksPerLayer = machine_test("vmem-blocks-per-layer", examples=120)
TestBlocksInterleaved = machine_test("vmem-blocks-interleaved", examples=60)
TestBlocksStraddling = machine_test("vmem-blocks-straddling", examples=60)


@pytest.mark.parametrize("layout", ["vmem-blocks-per-layer", "vmem-blocks-interleaved",
                                    "vmem-blocks-straddling"])
def test_random_mix_copies_block_hits(layout):
    """The machine's building blocks really produce block copies, from live, cached and
    reclaimable sources, and hit tokens that are not whole pages."""
    rng = random.Random(7)
    m = CacheModel(layout)
    tpp = m.manager.tokens_per_page
    partial_hits = 0
    for _ in range(300):
        roll = rng.random()
        if roll < 0.4 or not m.tokens:
            donor = m.tokens[rng.choice(sorted(m.tokens))] if m.tokens else \
                [rng.randrange(VOCAB) for _ in range(40)]
            prompt = (donor[:rng.randint(8, 47)] + [rng.randrange(VOCAB)])[:48]
            before = m.manager.prefix_hits
            m.step(m.admit(prompt))
            partial_hits += (m.manager.prefix_hits - before) % tpp != 0
        elif roll < 0.65:
            m.step(m.grow(rng.choice(sorted(m.tokens)), [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]))
        elif roll < 0.72:
            m.step(m.fork(rng.choice(sorted(m.tokens))))
        elif roll < 0.85:
            m.step(m.preempt(rng.choice(sorted(m.tokens)), rng.random() < 0.5))
        elif m.swapped:
            m.step(m.swap_in(rng.choice(sorted(m.swapped))))
        else:
            m.step(m.free(rng.choice(sorted(m.tokens))))
        m.check()
    assert m.events.get("block_copy", 0) >= 10, m.events
    assert partial_hits >= 10
    assert m.manager.block_hit_tokens > 0
    m.close()
