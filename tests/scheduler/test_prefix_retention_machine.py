"""Retention and eviction against a shadow model (hypothesis state machines), both layouts,
every eviction policy.

The shadow writes a token's content only when a step computes it (``compute`` then
``mark_computed``), as the runtime does, so a prefix hit on memory nobody has written yet reads
back wrong. After every step: reference counts equal the number of live tables holding each
unit; no cached unit is held or in a live table; ``cached_tokens`` and ``kv_cache_usage`` agree
with the cached and held units; every computed token reads back. With nothing live,
``reset_prefix_cache`` brings memory back to its baseline.
"""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vmemkv.scheduler.managers import EVICTION_POLICIES, PagedManager, VmemManager

from .shadow import PagedMemory, ShadowSeq, VmemMemory, ref_count
from ..hypothesis_budget import examples

ONE_LAYER_BYTES = 2                         # ModelSpec t1: 2 bytes per token
BASES = [[1, 2, 3] * 8, [2, 0] * 12]        # shared prefixes
TOKEN = st.integers(0, 3)
PICK = st.integers(0, 10**6)


class RetentionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = self.mem = None
        self.live = {}          # seq_id -> ShadowSeq
        self.computed = {}      # seq_id -> tokens computed
        self.next_id = 0

    @initialize(paged=st.booleans(), unit=st.sampled_from([1, 2, 4]), units=st.integers(3, 16),
                eviction=st.sampled_from(EVICTION_POLICIES))
    def setup(self, paged, unit, units, eviction):
        from vmemkv.scheduler.presets import ModelSpec
        model = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)
        self.unit, self.units = unit, units
        if paged:
            self.m = PagedManager(model, ONE_LAYER_BYTES * unit * units, 8 * unit,
                                  block_size_tokens=unit, prefix_eviction=eviction)
            self.mem = PagedMemory(self.m)
        else:
            self.m = VmemManager(model, ONE_LAYER_BYTES * unit * units, 8 * unit, page_bytes=unit,
                                 max_slots=4, prefix_eviction=eviction)
            self.mem = VmemMemory(self.m)

    def pick(self, pool, i):
        return sorted(pool)[i % len(pool)]

    def tables(self, sid):
        if isinstance(self.m, PagedManager):
            return self.m.block_table(sid)
        pages = self.m.mapped_pages(self.m.slot_of(sid))
        return [pages[pi] for pi in range(-(-self.live[sid].num_tokens // self.unit))]

    def replay(self, writes=()):
        self.mem.replay(self.m.take_ops(), self.live, writes)

    @rule(base=st.integers(0, 1), plen=st.integers(3, 14), tail=st.lists(TOKEN, max_size=3),
          salt=st.sampled_from([None, None, "s"]), prefill=st.booleans())
    def allocate(self, base, plen, tail, salt, prefill):
        ids = BASES[base][:plen] + tail
        n = len(ids)
        if n > self.m.max_sequence_tokens or not self.m.can_allocate(n, ids, salt):
            return
        sid, self.next_id = self.next_id, self.next_id + 1
        hit = self.m.allocate(sid, n, ids, salt)
        assert hit % self.unit == 0 and 0 <= hit <= n - 1
        s = ShadowSeq(ids, salt)
        s.num_tokens = n
        self.live[sid], self.computed[sid] = s, hit
        self.replay()
        assert self.mem.read(sid, hit) == s.contents[:hit], "a hit read unwritten memory"
        if prefill:                     # the step that computes the whole prompt
            self.compute(sorted(self.live).index(sid), n)

    @precondition(lambda self: self.live)
    @rule(i=PICK, k=st.integers(1, 12))
    def compute(self, i, k):
        """A step computes up to ``k`` pending tokens: written, then published."""
        sid = self.pick(self.live, i)
        old = self.computed[sid]
        new = min(self.live[sid].num_tokens, old + k)
        self.replay([(sid, old, new)])
        self.m.mark_computed(sid, new)
        self.computed[sid] = new

    @precondition(lambda self: any(self.computed[s] == self.live[s].num_tokens for s in self.live))
    @rule(i=PICK, k=st.integers(1, 3), fresh=st.lists(TOKEN, min_size=3, max_size=3))
    def decode(self, i, k, fresh):
        """A fully computed sequence grows (its new tokens are pending until computed)."""
        sid = self.pick([s for s in self.live if self.computed[s] == self.live[s].num_tokens], i)
        s = self.live[sid]
        if not self.m.can_append(sid, k):
            return
        s.extend_ids(fresh[:k])
        self.m.append(sid, k, fresh[:k])
        s.num_tokens += k
        self.replay()

    @precondition(lambda self: any(self.computed[s] == self.live[s].num_tokens for s in self.live))
    @rule(i=PICK)
    def fork(self, i):
        parent = self.pick([s for s in self.live if self.computed[s] == self.live[s].num_tokens], i)
        if not self.m.can_fork(parent):
            return
        child, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent, child)
        self.live[child], self.computed[child] = self.live[parent].copy(), self.computed[parent]
        self.replay()

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def free(self, i):
        sid = self.pick(self.live, i)
        self.m.free(sid, computed_tokens=self.computed.pop(sid))
        del self.live[sid]
        self.replay()

    @precondition(lambda self: self.live)
    @rule(i=PICK, k=st.integers(0, 12))
    def fail_after_a_bad_write(self, i, k):
        """A step writes wrong K/V for up to ``k`` pending tokens (a NaN no check saw) and is
        recorded (published); then its request fails: ``unpublish``, then ``free``. No later
        hit reads what it wrote (``allocate``'s read-back); what others hold stays theirs."""
        sid = self.pick(self.live, i)
        s, old = self.live.pop(sid), self.computed.pop(sid)
        new = min(s.num_tokens, old + k)
        for pos in range(old, new):
            self.mem.write(sid, pos, ("wrong", s.contents[pos]))
        self.m.mark_computed(sid, new)
        self.m.unpublish(sid)
        self.m.free(sid, computed_tokens=new)
        self.replay()
        self.hit_reads_back(s)

    def hit_reads_back(self, s):
        """Allocate ``s``'s tokens once more and read its hit back, then undo it all (the
        manager's transaction, the shadow's copy): a prefix the failed one wrote reads wrong."""
        n, saved = s.num_tokens, self.mem.save()
        self.m.begin()
        if self.m.can_allocate(n, s.ids[:n], s.namespace):
            hit = self.m.allocate(self.next_id, n, s.ids[:n], s.namespace)
            self.mem.replay(self.m.take_ops(), {})
            assert self.mem.read(self.next_id, hit) == s.contents[:hit], "a failed one's K/V hit"
        self.m.rollback()
        self.mem.load(saved)

    @precondition(lambda self: not self.live and self.m.cached_tokens)
    @rule()
    def everything_evicted_is_the_baseline(self):
        self.m.reset_prefix_cache()
        self.replay()
        st_ = self.m.stats()
        still_mapped = getattr(self.m, "reclaimable_tokens", 0)   # vmem: no content, mapped
        assert st_.free_tokens + still_mapped == st_.total_tokens
        assert st_.live_tokens == 0 and self.m.cached_tokens == 0
        assert self.m.kv_cache_usage() == 0.0

    @invariant()
    def refs_cached_and_usage_agree(self):
        if self.m is None:
            return
        m = self.m
        m.check_integrity()
        holders = {}
        for sid in self.live:
            for u in self.tables(sid):
                holders[u] = holders.get(u, 0) + 1
        assert all(ref_count(m, u) == holders.get(u, 0) for u in range(self.units))
        cached = m.cached_units()
        assert len(set(cached)) == len(cached) and not set(cached) & set(holders), \
            "a cached unit is also in use"
        assert m.cached_tokens == len(cached) * self.unit
        assert abs(m.kv_cache_usage() - len(holders) / self.units) < 1e-9
        for sid, s in self.live.items():
            n = self.computed[sid]
            assert self.mem.read(sid, n) == s.contents[:n], sid


TestRetentionMatchesShadow = RetentionMachine.TestCase
TestRetentionMatchesShadow.settings = settings(max_examples=examples(200), stateful_step_count=40,
                                               deadline=None)
