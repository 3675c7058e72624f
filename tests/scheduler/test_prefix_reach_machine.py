"""The managers keep only reachable prefix registrations (hypothesis state machines, vmem and
paged, each one-kind and hybrid): sequences over a few prompts that share leading units,
growing by tokens from a small alphabet (so concurrent sequences compute duplicate units and
chain on each other's), on a pool small enough to evict, a hybrid's window sliding after every
step, frees (some rolled back: registrations, cached units and tokens as before) and cache
resets. Invariants after every step: integrity (``ChainedPrefixIndex.check``: no registration
outlives its parent); every registration is what ``match`` finds for its own chain of keys, so
every cached unit can serve a hit and ``cached_tokens`` counts only those; a paged hybrid's
every prefix node holds each full group's block (a hit reads them all) and is what ``chain``
finds for its own keys."""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vmemkv.scheduler.managers import PagedManager, VmemManager, make_manager
from vmemkv.scheduler.presets import ModelSpec

from ..hypothesis_budget import examples

UNIT_TOKENS, WINDOW, MAX_TOKENS = 4, 8, 48
MODELS = {"hybrid": ModelSpec("g3", 6, 1, 1, 1, weight_bytes=0,
                              layer_windows=(WINDOW,) * 5 + (None,)),
          "one-kind": ModelSpec("llama", 6, 1, 1, 1, weight_bytes=0)}
PAGED_GROUPS = {"hybrid": 6, "one-kind": 1}
PROMPTS = (list(range(100, 130)),                                  # shares units 0 and 1
           list(range(100, 108)) + list(range(200, 222)),          # with this one, unit 0
           list(range(100, 104)) + list(range(300, 326)))          # with this one
PICK = st.integers(0, 10**6)
SETTINGS = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)


def chain_keys(index, unit) -> list:
    """The keys of ``unit``'s registration and of every one it is chained on, first first."""
    by_serial = {reg.serial: reg for reg in index.by_unit.values()}
    reg, keys = index.by_unit[unit], []
    while reg is not None:
        keys.append(reg.key)
        assert reg.parent_serial is None or reg.parent_serial in by_serial, \
            ("a registration outlived the one it is chained on", unit)
        reg = None if reg.parent_serial is None else by_serial[reg.parent_serial]
    return keys[::-1]


def node_keys(index, serial) -> list:
    """The keys of a paged hybrid index's prefix node and of every node before it, first first."""
    keys = []
    while serial is not None:
        node = index.nodes[serial]
        keys.append(node.key)
        serial = node.parent
    return keys[::-1]


def assert_every_registration_matches_its_chain(m) -> None:
    for unit in m.prefix.by_unit:
        keys = chain_keys(m.prefix, unit)
        assert m.prefix.match(keys)[-1:] == [unit], ("unreachable registration", unit)
    assert m.cached_tokens == len(m.cached_units()) * UNIT_TOKENS


class ReachRules(RuleBasedStateMachine):
    """The rules both layouts run; a subclass builds ``self.m`` and checks it."""

    def _pick(self, i):
        return sorted(self.ids)[i % len(self.ids)] if self.ids else None

    def _computed(self, sid):
        n = len(self.ids[sid])
        self.m.mark_computed(sid, n)
        self.m.release_behind_window(sid, n)

    # whole units (two at once compute duplicates), 10 (a hybrid's window still reads unit 0),
    # 12 and 16 (past it: the windowed kind's leading units are given back)
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

    @rule(i=PICK, rolled_back=st.booleans())
    def fail(self, i, rolled_back):
        """A sequence's request fails: ``unpublish`` then ``free`` (some rolled back: every
        registration, block entry and cached unit as before). No unit it held stays findable
        (a registration, a vmem group's blocks), nor anything chained below one."""
        sid = self._pick(i)
        if sid is None:
            return
        held, before = self._held(sid), self._findable()
        cached, tokens = self.m.cached_units(), self.m.cached_tokens
        self.m.begin()
        self.m.unpublish(sid)
        assert not held & self._findable(), "a failed sequence's unit is findable"
        self.m.free(sid)
        assert not held & self._findable(), "a failed sequence's unit is findable after free"
        if rolled_back:
            self.m.rollback()
            assert self._findable() == before and self.m.cached_units() == cached
            assert self.m.cached_tokens == tokens
            return
        self.m.commit()
        del self.ids[sid]

    def _held(self, sid) -> set:
        m = self.m
        if isinstance(m, PagedManager):
            return {b for table in m.block_tables(sid) for b in table if b is not None}
        pages = m.mapped_pages(m.slot_of(sid))
        return {pages[p] for p in range(-(-len(self.ids[sid]) // m.tokens_per_page))
                if p in pages}

    def _findable(self) -> set:
        """Units a prompt may find: registered, or (vmem) holding blocks."""
        blocks = self.m.blocks if isinstance(self.m, VmemManager) else None
        return set(self.m.prefix.by_unit) | (set(blocks.by_group) if blocks else set())


class VmemReach(ReachRules):
    @initialize(kind=st.sampled_from(sorted(MODELS)), evict=st.sampled_from(["lru", "hits"]),
                groups=st.integers(5, 10))
    def setup(self, kind, evict, groups):
        self.m = make_manager("vmem", MODELS[kind], groups * 12 * UNIT_TOKENS, MAX_TOKENS,
                              page_bytes=UNIT_TOKENS, max_slots=4, prefix_eviction=evict,
                              hybrid_parts=kind == "hybrid")
        self.ids, self.next_id = {}, 0

    @invariant()
    def every_registration_is_what_its_chain_matches(self):
        self.m.check_integrity()
        assert_every_registration_matches_its_chain(self.m)


class PagedReach(ReachRules):
    @initialize(kind=st.sampled_from(sorted(MODELS)), evict=st.sampled_from(["lru", "hits"]),
                blocks_per_group=st.integers(5, 12))
    def setup(self, kind, evict, blocks_per_group):
        layers_bytes = UNIT_TOKENS * 2 * 6       # a block of every (1-byte) layer: one per group
        self.m = make_manager("paged", MODELS[kind], blocks_per_group * layers_bytes,
                              MAX_TOKENS, block_size_tokens=UNIT_TOKENS, prefix_eviction=evict)
        assert self.m.num_blocks == blocks_per_group * PAGED_GROUPS[kind]
        self.ids, self.next_id = {}, 0

    @invariant()
    def every_registration_is_reachable(self):
        m = self.m
        m.check_integrity()
        if not m._hybrid:
            assert_every_registration_matches_its_chain(m)
            return
        full = [g for g, group in enumerate(m.groups) if group.window_tokens is None]
        for serial in m.prefix.nodes:
            assert all((serial, g) in m.prefix.blocks for g in full), \
                ("a prefix node without a full group's block: nothing below is reachable", serial)
            assert m.prefix.chain(node_keys(m.prefix, serial))[-1:] == [serial], serial


TestVmemKeepsOnlyReachableRegistrations = VmemReach.TestCase
TestVmemKeepsOnlyReachableRegistrations.settings = SETTINGS
TestPagedKeepsOnlyReachableRegistrations = PagedReach.TestCase
TestPagedKeepsOnlyReachableRegistrations.settings = SETTINGS
