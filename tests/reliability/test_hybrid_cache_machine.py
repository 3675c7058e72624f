"""The cache state machine (test_cache_state_machines' rules: admit, prefix sharing, grow, fork,
preempt by recompute or swap, swap in, free, a driver fault in a step) over a HYBRID model on
the vmem per-layer layout (layers 0 and 2 windowed by 8 tokens, layer 1 full; 4 KiB pages of 32
tokens, 4 per slot), plus a rule that gives back the memory behind a sequence's window
(``release_behind_window``): the real hybrid manager plans extent ops naming its ledger's pool pages and the pool executes
them. After every step: manager and cache agree (the extents mapped per slot), every
resident sequence's K/V equal the truth (windowed layers from the first page they still hold),
and a faulted step leaves everything as before, then succeeds when retried."""
from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import precondition, rule

from vmemkv.runtime.config import CacheConfig

from .model import CacheModel
from .test_cache_state_machines import CacheMachine
from ..hypothesis_budget import examples

HYBRID = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=16, max_batch=4, max_context=128,
                     layer_windows=(8, None, 8))


def hybrid_model(layout: str) -> CacheModel:
    return CacheModel(layout, config=HYBRID, cache_fraction=2.5, swap_seqs=2.0)


class HybridCacheMachine(CacheMachine):
    layout = "vmem-per-layer"

    def __init__(self) -> None:
        super(CacheMachine, self).__init__()
        self.model = hybrid_model(self.layout)
        assert self.model.cache.cache.pool_pages is not None, "a hybrid pool was meant"

    @precondition(lambda self: self.model.tokens)
    @rule(index=st.integers(0, 99))
    def slide(self, index):
        """The next step's query of a sequence is at its length: give back what lies behind."""
        m = self.model
        seq_id = self._pick(m.tokens, index)

        def mutate():
            m.manager.release_behind_window(seq_id, len(m.tokens[seq_id]))
            return ("slide", seq_id, None, [])
        m.step(mutate)


class HybridCacheMapperMachine(HybridCacheMachine):
    layout = "vmem-per-layer-mapper"


TestHybridCacheMachine = HybridCacheMachine.TestCase
TestHybridCacheMachine.settings = settings(max_examples=examples(150), stateful_step_count=25, deadline=None)
TestHybridCacheMapperMachine = HybridCacheMapperMachine.TestCase
TestHybridCacheMapperMachine.settings = settings(max_examples=examples(60), stateful_step_count=25,
                                                 deadline=None)


def test_the_slide_rule_gives_back_window_parts_while_forks_and_prefixes_share_them():
    """The building blocks really produce window parts given back under a shared group."""
    m = hybrid_model("vmem-per-layer")
    m.step(m.admit(list(range(7)) * 10))                 # 70 tokens: pages 0..2
    m.step(m.fork(0))
    m.step(m.admit(list(range(7)) * 5))                  # shares a prefix with 0
    for seq_id in (0, 1):
        def mutate(seq_id=seq_id):
            m.manager.release_behind_window(seq_id, 70)  # keys from 63 on: page 0 behind
            return ("slide", seq_id, None, [])
        m.step(mutate)
    m.check()
    cache = m.cache.cache
    # the window kind's pages of page 0 are back in the ledger: mapped nowhere, bound to nothing
    assert cache.mapped_pool_pages <= m.manager.bound_pages == m.manager.pool_pages - \
        m.manager.ledger.free_pages
    for seq_id in (0, 1):
        slot = m.manager.slot_of(seq_id)
        extents = cache.mapped_extents(slot)
        assert extents == m.manager.mapped_extents(slot)
        assert [sorted(extents[pi]) for pi in sorted(extents)] == [["full"], ["full", "window-8"],
                                                                 ["full", "window-8"]]
    m.close()
