"""The paged manager keeps only reachable prefix registrations (a hypothesis state machine, as
test_vmem_reach_machine.py for vmem): sequences over a few prompts that share leading blocks,
growing by tokens from a small alphabet (so concurrent sequences compute duplicate blocks and
chain on each other's), on a pool small enough to evict, a hybrid's window sliding after
every step, frees (some rolled back) and cache resets.
Invariants after every step: integrity; one-kind, every registered block is what ``match``
finds for its own chain of keys (none outlives the one it is chained on); hybrid, every
prefix node holds each full group's block (a hit reads them all, so below a node without one
nothing could be hit) and is what ``chain`` finds for its own keys."""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vmemkv.scheduler.managers import make_manager

from ..hypothesis_budget import examples
from .test_vmem_reach_machine import MODELS, PICK, PROMPTS, chain_keys

BS, MAX_TOKENS = 4, 48
GROUPS = {"hybrid": 6, "one-kind": 1}


def node_keys(index, serial) -> list:
    """The keys of a hybrid index's prefix node and of every node before it, first first."""
    keys = []
    while serial is not None:
        node = index.nodes[serial]
        keys.append(node.key)
        serial = node.parent
    return keys[::-1]


class PagedReachMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(sorted(MODELS)), evict=st.sampled_from(["lru", "hits"]),
                blocks_per_group=st.integers(5, 12))
    def setup(self, kind, evict, blocks_per_group):
        groups = GROUPS[kind]
        layers_bytes = BS * 2 * 6            # a block of every (1-byte) layer: one per group
        self.m = make_manager("paged", MODELS[kind], blocks_per_group * layers_bytes, MAX_TOKENS,
                              block_size_tokens=BS, prefix_eviction=evict)
        assert self.m.num_blocks == blocks_per_group * groups
        self.ids, self.next_id = {}, 0

    def _pick(self, i):
        return sorted(self.ids)[i % len(self.ids)] if self.ids else None

    def _computed(self, sid):
        n = len(self.ids[sid])
        self.m.mark_computed(sid, n)
        self.m.release_behind_window(sid, n)

    # whole blocks (two at once compute duplicates), 10 (a hybrid's window still reads block 0),
    # 12 and 16 (past it: the windowed groups' leading blocks are given back)
    @rule(prompt=st.integers(0, len(PROMPTS) - 1), n=st.sampled_from([3, 4, 8, 10, 12, 16]))
    def start(self, prompt, n):
        ids = PROMPTS[prompt][:n]
        if not self.m.can_allocate(n, ids):
            return
        sid, self.next_id = self.next_id, self.next_id + 1
        self.m.allocate(sid, n, ids)
        self.ids[sid] = list(ids)
        self._computed(sid)

    @rule(i=PICK, token=st.integers(0, 2), count=st.integers(1, 4))
    def grow(self, i, token, count):
        sid = self._pick(i)
        if sid is None or len(self.ids[sid]) + count > MAX_TOKENS or \
                not self.m.can_append(sid, count):
            return
        self.m.append(sid, count, [token] * count)
        self.ids[sid] += [token] * count
        self._computed(sid)

    @rule(i=PICK, rolled_back=st.booleans())
    def finish(self, i, rolled_back):
        sid = self._pick(i)
        if sid is None:
            return
        if rolled_back:
            registered, cached = dict(self.m.prefix.by_unit), self.m.cached_units()
            tokens = self.m.cached_tokens
            self.m.begin()
            self.m.free(sid)
            self.m.rollback()
            assert dict(self.m.prefix.by_unit) == registered
            assert self.m.cached_units() == cached and self.m.cached_tokens == tokens
            return
        self.m.free(sid)
        del self.ids[sid]

    @rule()
    def reset(self):
        self.m.reset_prefix_cache()
        assert self.m.cached_units() == [] and self.m.cached_tokens == 0

    @invariant()
    def every_registration_is_reachable(self):
        m = self.m
        m.check_integrity()
        if not m._hybrid:
            for unit in m.prefix.by_unit:
                keys = chain_keys(m.prefix, unit)
                assert m.prefix.match(keys)[-1:] == [unit], ("unreachable registration", unit)
            assert m.cached_tokens == len(m.cached_units()) * BS
            return
        full = [g for g, group in enumerate(m.groups) if group.window_tokens is None]
        for serial in m.prefix.nodes:
            assert all((serial, g) in m.prefix.blocks for g in full), \
                ("a prefix node without a full group's block: nothing below is reachable", serial)
            assert m.prefix.chain(node_keys(m.prefix, serial))[-1:] == [serial], serial


TestPagedKeepsOnlyReachableRegistrations = PagedReachMachine.TestCase
TestPagedKeepsOnlyReachableRegistrations.settings = settings(
    max_examples=examples(60), stateful_step_count=40, deadline=None)
