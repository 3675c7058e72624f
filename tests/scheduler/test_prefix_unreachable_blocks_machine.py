"""vmem caches only block-granular prefix entries a prompt can hit (a hypothesis state machine,
the rules of test_prefix_reach_machine.py on 8-token pages of two 4-token blocks, one-kind:
blocks are off beside a window). Page p's blocks are keyed on page p-1's digest and a prompt
reaches them only through whole-page hits on pages 0..p-1, so they are hittable exactly while
a registration holds that digest. Invariants after every step: integrity; every registration
is what ``match`` finds for its own chain; every cached group's blocks are what a prompt of
that chain finds (``BlockIndex.match`` after a whole-page hit of length p), so
``cached_tokens`` counts only tokens a later request can hit."""
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.managers.prefix import namespace_root

from .prefix_reach_helpers import FULL_ONLY
from .test_prefix_reach_machine import MAX_TOKENS, SETTINGS, ReachRules, chain_keys

PAGE_TOKENS, BLOCK_TOKENS = 8, 4


def assert_every_cached_block_is_hittable(m) -> None:
    by_digest, root = m.prefix.by_digest, namespace_root(None, m.model.kv_encoding)
    for g in m.cached_units():
        entry = m.blocks.by_group.get(g)
        if entry is None:
            continue
        if entry.parent != root:       # page p > 0: its prompt hits pages 0..p-1 first
            assert entry.parent in by_digest, ("blocks after a page no prompt reaches", g)
            keys = chain_keys(m.prefix, by_digest[entry.parent].unit)
            assert len(m.prefix.match(keys)) == len(keys)
        blocks = len(entry.digests)
        groups, found = m.blocks.match(entry.parent, entry.tokens, blocks)
        assert g in groups and found == blocks, ("cached blocks no prompt finds", g)


class VmemBlocksReach(ReachRules):
    @initialize(evict=st.sampled_from(["lru", "hits"]), groups=st.integers(4, 8))
    def setup(self, evict, groups):
        layers_bytes = 6 * 2 * PAGE_TOKENS      # a page of every (1-byte) layer, K and V
        self.m = make_manager("vmem", FULL_ONLY, groups * layers_bytes, MAX_TOKENS,
                              page_bytes=PAGE_TOKENS, max_slots=4, prefix_eviction=evict,
                              prefix_block_tokens=BLOCK_TOKENS)
        assert (self.m.tokens_per_page, self.m.block_tokens) == (PAGE_TOKENS, BLOCK_TOKENS)
        self.ids, self.next_id = {}, 0

    @invariant()
    def every_cached_block_is_hittable(self):
        m = self.m
        m.check_integrity()
        for unit in m.prefix.by_unit:
            assert m.prefix.match(chain_keys(m.prefix, unit))[-1:] == [unit], unit
        assert_every_cached_block_is_hittable(m)


TestVmemCachesOnlyHittableBlocks = VmemBlocksReach.TestCase
TestVmemCachesOnlyHittableBlocks.settings = SETTINGS
