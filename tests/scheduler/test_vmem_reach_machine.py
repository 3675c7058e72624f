"""vmem keeps only reachable prefix registrations (a hypothesis state machine): sequences over
a few prompts that share leading pages, growing by tokens from a small alphabet (so
concurrent sequences compute duplicate pages and chain on each other's), on a pool small
enough to evict, a hybrid's window sliding after every step, frees (some rolled back).
Invariants after every step: integrity (``ChainedPrefixIndex.check``: no registration outlives
its parent); every registered group is what ``match`` finds for its own chain of keys, so
every cached group can serve a hit and ``cached_tokens`` counts only such groups."""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec

from ..hypothesis_budget import examples

TPP, WINDOW, MAX_TOKENS = 4, 8, 48
MODELS = {"hybrid": ModelSpec("g3", 6, 1, 1, 1, weight_bytes=0,
                              layer_windows=(WINDOW,) * 5 + (None,)),
          "one-kind": ModelSpec("llama", 6, 1, 1, 1, weight_bytes=0)}
PROMPTS = (list(range(100, 130)),                                  # shares pages 0 and 1
           list(range(100, 108)) + list(range(200, 222)),          # with this one, page 0
           list(range(100, 104)) + list(range(300, 326)))          # with this one
PICK = st.integers(0, 10**6)


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


class ReachMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(sorted(MODELS)), evict=st.sampled_from(["lru", "hits"]),
                groups=st.integers(5, 10))
    def setup(self, kind, evict, groups):
        self.m = make_manager("vmem", MODELS[kind], groups * 12 * TPP, MAX_TOKENS,
                              page_bytes=TPP, max_slots=4, prefix_eviction=evict,
                              hybrid_parts=kind == "hybrid")
        self.ids, self.next_id = {}, 0

    def _pick(self, i):
        return sorted(self.ids)[i % len(self.ids)] if self.ids else None

    def _computed(self, sid):
        n = len(self.ids[sid])
        self.m.mark_computed(sid, n)
        self.m.release_behind_window(sid, n)

    # whole pages (two at once compute duplicates), 10 (a hybrid's window still reads page 0),
    # 12 and 16 (past it: a hit on a cached page 0 releases it, and what is chained below)
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
            self.m.begin()
            self.m.free(sid)
            self.m.rollback()
            assert dict(self.m.prefix.by_unit) == registered
            assert self.m.cached_units() == cached
            return
        self.m.free(sid)
        del self.ids[sid]

    @rule()
    def reset(self):
        self.m.reset_prefix_cache()
        assert self.m.cached_units() == [] and self.m.cached_tokens == 0

    @invariant()
    def every_registration_is_what_its_chain_matches(self):
        m = self.m
        m.check_integrity()
        for unit in m.prefix.by_unit:
            keys = chain_keys(m.prefix, unit)
            assert m.prefix.match(keys)[-1:] == [unit], ("unreachable registration", unit)
        assert m.cached_tokens == len(m.cached_units()) * TPP


TestVmemKeepsOnlyReachableRegistrations = ReachMachine.TestCase
TestVmemKeepsOnlyReachableRegistrations.settings = settings(
    max_examples=examples(60), stateful_step_count=40, deadline=None)
