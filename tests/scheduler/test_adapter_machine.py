"""LoRA adapters as tenants of the page ledger (scheduler/managers/adapters.py) against a shadow:
a hypothesis state machine over adapter acquire / release / evict, KV allocate (with an
adapter, as the scheduler admits, or without) / append / fork / free, and (vmem) resize, each
inside a transaction committed or rolled back at random, on vmem per-layer, interleaved and a
byte-mapped hybrid, and on paged (a plain and a hybrid model), each with adapters sharing the
pool or in a static split (``adapter_budget_bytes``).

After every rule: the integrity check holds and every ledger page is free, a KV tenant's, an
adapter's or RELEASED exactly once (free + KV + adapters + released == pool); the resident
adapters, their use counts, the idle LRU order and the load/eviction counters equal the
shadow's; the ops, replayed on a replica of what an executor holds, never load an adapter into
a page KV maps (or a block a sequence's table names) nor map a page an adapter holds. Idle
adapters go last and before any failure: an eviction made for KV happens only when no free,
reclaimable or cached group (block) is left, always the least recently idle adapter; a KV
allocation or append refused is still refused with every idle adapter evicted; an admission
``can_allocate(..., adapter=)`` says yes to is carried out exactly (acquire, then allocate).
"""
import hashlib

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vmemkv.scheduler.adapters import AdapterRef, AdapterStateError
from vmemkv.scheduler.errors import OutOfCapacityError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.managers.base import EvictAdapter, LoadAdapter
from vmemkv.scheduler.managers.ledger import RELEASED
from vmemkv.scheduler.presets import ModelSpec

from ..hypothesis_budget import examples
from .adapter_replica import UnitReplica

UNIFORM = ModelSpec("u4", 4, 1, 2, 2, weight_bytes=0)          # 8 bytes a layer-token
HYBRID = ModelSpec("h4", 4, 3, 1, 1, weight_bytes=0, layer_windows=(None, 6, 6, 6))
GEOMETRIES = {   # name: (policy, model, options, max tokens)
    "per-layer": ("vmem", UNIFORM, dict(page_bytes=32, layout="per-layer"), 16),
    "interleaved": ("vmem", UNIFORM, dict(page_bytes=128, layout="interleaved"), 16),
    "bytes-hybrid": ("vmem", HYBRID, dict(page_bytes=4, layout="per-layer",
                                          hybrid_parts=True), 12),
    "paged": ("paged", UNIFORM, dict(block_size_tokens=4), 16),
    "paged-hybrid": ("paged", HYBRID, dict(block_size_tokens=2), 12),
}


def adapter(name: str, key: str, units: int, unit_bytes: int) -> AdapterRef:
    """An adapter of ``units`` pool units, its last one part full."""
    return AdapterRef(name, hashlib.sha256(key.encode()).hexdigest(),
                      units * unit_bytes - unit_bytes // 2)


class AdapterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = None

    @initialize(geometry=st.sampled_from(sorted(GEOMETRIES)), slices=st.integers(3, 9),
                split=st.sampled_from([None, None, None, 2, 5]),
                evict=st.sampled_from(["lru", "off"]),
                sizes=st.lists(st.integers(1, 45), min_size=3, max_size=3))
    def setup(self, geometry, slices, split, evict, sizes):
        policy, model, options, max_tokens = GEOMETRIES[geometry]
        vmem = policy == "vmem"
        probe = make_manager(policy, model, 1 << 12, max_tokens, **options,   # its geometry
                             **(dict(max_slots=1) if vmem else {}))
        unit_bytes = probe.page_bytes if vmem else probe.block_bytes
        slice_bytes = probe.page_bytes * probe.geometry.num_members if vmem else \
            probe.block_bytes * len(probe.groups)
        budget = None if split is None else split * unit_bytes
        cache = slices * slice_bytes + (budget or 0)
        extra = dict(max_slots=4) if vmem else {}
        if vmem and split is None:
            extra["max_cache_bytes"] = cache + 2 * slice_bytes     # resize may grow it
        self.m = m = make_manager(policy, model, cache, max_tokens, prefix_eviction=evict,
                                  adapter_budget_bytes=budget, **options, **extra)
        self.vmem, self.max_tokens, self.slice_bytes = vmem, max_tokens, slice_bytes
        # two adapters named "a" (other weights: other digests) and one "b", each of a share
        # (sizes: percent) of the KV pool
        pool = slices * slice_bytes // unit_bytes
        units = [max(1, pool * pct // 100) for pct in sizes]
        self.adapters = [adapter("a", "a-1", units[0], unit_bytes),
                         adapter("a", "a-2", units[1], unit_bytes),
                         adapter("b", "b-1", units[2], unit_bytes)]
        self.live: dict = {}           # seq id -> tokens
        self.seq_adapter: dict = {}    # seq id -> the adapter it pinned (admitted with one)
        self.uses: dict = {}           # digest -> uses (resident ones)
        self.idle: list = []           # digests, least recently idle first
        self.loads = self.evictions = 0
        self.next_id = 0
        self.replica = UnitReplica(m)  # the executor's view, from the committed ops
        self.kv_evictions_checked = 0
        real = m._evict_adapter_for_kv

        def watched():   # an eviction for KV: nothing else of KV's was left to reclaim
            if m._adapters_share_kv and m._idle_adapters:
                if vmem:
                    assert not m._reclaimable and not len(m._cache) and not m._free, \
                        "an idle adapter evicted before KV's own free memory"
                else:
                    assert not len(m._cache) and not m._ledger.free_pages, \
                        "an idle adapter evicted before a free or cached block"
                self.kv_evictions_checked += 1
            return real()
        m._evict_adapter_for_kv = watched

    # -- transactions and the op replica --
    def _state(self):
        return (dict(self.live), dict(self.seq_adapter), dict(self.uses), list(self.idle),
                self.loads, self.evictions)

    def _restore(self, state):
        (self.live, self.seq_adapter, self.uses, self.idle, self.loads,
         self.evictions) = state

    def _txn(self, change, commit: bool):
        m = self.m
        m.begin()
        before = self._state()
        try:
            change()
        except BaseException:
            m.rollback()
            self._restore(before)
            raise
        ops = m.take_ops()
        if commit:
            m.commit()
            self.replica.apply(ops, self.live)
        else:
            m.rollback()
            assert m.take_ops() == [], "a rollback keeps no op"
            self._restore(before)

    def _evicted(self, ops) -> None:
        """EvictAdapter ops in ``ops`` take the least recently idle adapters, in order."""
        gone = [op.adapter_id for op in ops if type(op) is EvictAdapter]
        assert gone == self.idle[:len(gone)], (gone, self.idle)
        for digest in gone:
            self.idle.remove(digest)
            del self.uses[digest]
        self.evictions += len(gone)

    # -- adapters --
    @precondition(lambda self: self.m is not None)
    @rule(i=st.integers(0, 2), commit=st.booleans())
    def acquire(self, i, commit):
        m, ref = self.m, self.adapters[i]
        if not m.can_acquire_adapter(ref):
            before = (m.adapter_stats(), m.stats(), m.ledger.free_pages if self.vmem
                      else m._ledger.free_pages)
            with pytest.raises(OutOfCapacityError, match="adapter 'a'|adapter 'b'"):
                m.acquire_adapter(ref)
            assert (m.adapter_stats(), m.stats(), m.ledger.free_pages if self.vmem
                    else m._ledger.free_pages) == before, "a refused load changed something"
            return

        def go():
            m.acquire_adapter(ref, owner_seq_id=99)
            ops = m.take_ops()
            self._evicted(ops)
            if ref.digest in self.uses:
                assert not any(type(op) is LoadAdapter for op in ops), "pinning an idle one loads"
                if self.uses[ref.digest] == 0:
                    self.idle.remove(ref.digest)
                self.uses[ref.digest] += 1
            else:
                loads = [op for op in ops if type(op) is LoadAdapter]
                assert len(loads) == 1 and loads[0].adapter_id == ref.digest and \
                    loads[0].owner == 99 and loads[0].num_bytes == ref.num_bytes
                self.uses[ref.digest] = 1
                self.loads += 1
            m._ops.extend(ops)
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None)
    @rule(i=st.integers(0, 2))
    def warm(self, i):
        """A request ran with adapter i and ended: resident, idle (committed)."""
        m, ref = self.m, self.adapters[i]
        if not m.can_acquire_adapter(ref):
            return

        def go():
            m.acquire_adapter(ref)
            m.release_adapter(ref)
            ops = m.take_ops()
            self._evicted(ops)
            if ref.digest not in self.uses:
                self.uses[ref.digest] = 0
                self.loads += 1
                self.idle.append(ref.digest)
            elif self.uses[ref.digest] == 0:      # idle: now the most recently idle
                self.idle.remove(ref.digest)
                self.idle.append(ref.digest)
            m._ops.extend(ops)
        self._txn(go, True)

    @precondition(lambda self: self.m is not None)
    @rule(i=st.integers(0, 2), commit=st.booleans())
    def release(self, i, commit):
        m, ref = self.m, self.adapters[i]
        pinned = self.uses.get(ref.digest, 0) - sum(
            1 for a in self.seq_adapter.values() if a is ref)
        if pinned <= 0:          # only the rule's own pins (a sequence's go with it)
            if not self.uses.get(ref.digest):
                with pytest.raises(AdapterStateError, match="released more often"):
                    m.release_adapter(ref)
            return

        def go():
            m.release_adapter(ref)
            self.uses[ref.digest] -= 1
            if not self.uses[ref.digest]:
                self.idle.append(ref.digest)
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None)
    @rule(commit=st.booleans())
    def evict_idle(self, commit):
        def go():
            assert self.m.evict_idle_adapter() == bool(self.idle)
            ops = self.m.take_ops()
            self._evicted(ops)
            self.m._ops.extend(ops)
        self._txn(go, commit)

    # -- KV --
    def _still_refused(self, can) -> None:
        """A refused KV call stays refused with every idle adapter evicted (their pages were
        counted as room already)."""
        m = self.m
        m.begin()
        try:
            while m.evict_idle_adapter():
                pass
            assert not can(), "evicting idle adapters would have made room"
        finally:
            m.rollback()
            m.take_ops()

    def _kv(self, change, commit):
        def go():
            change()
            ops = self.m.take_ops()
            self._evicted(ops)
            assert not any(type(op) is LoadAdapter for op in ops)
            self.m._ops.extend(ops)
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None)
    @rule(tokens=st.integers(1, 16), shared=st.booleans(), with_adapter=st.sampled_from(
        [None, None, 0, 1, 2]), commit=st.booleans())
    def allocate(self, tokens, shared, with_adapter, commit):
        m = self.m
        tokens = min(tokens, self.max_tokens)
        ids = list(range(tokens)) if shared else [1000 + self.next_id] * tokens
        ref = None if with_adapter is None else self.adapters[with_adapter]
        scope = None if ref is None else ref.digest    # (the scheduler's scope carries it)
        kw = {} if ref is None else {"adapter": ref}
        if not m.can_allocate(tokens, ids, scope, **kw):
            if tokens <= m.max_sequence_tokens and m._can_place():
                self._still_refused(lambda: m.can_allocate(tokens, ids, scope, **kw))
            return
        sid = self.next_id
        self.next_id += 1

        def go():
            if ref is not None:           # the scheduler's admission: adapter, then KV
                m.acquire_adapter(ref, owner_seq_id=sid)
                ops = m.take_ops()
                self._evicted(ops)
                if ref.digest in self.uses:
                    if self.uses[ref.digest] == 0:
                        self.idle.remove(ref.digest)
                    self.uses[ref.digest] += 1
                else:
                    self.uses[ref.digest] = 1
                    self.loads += 1
                m._ops.extend(ops)
                self.seq_adapter[sid] = ref
            before = m.take_ops()
            m.allocate(sid, tokens, ids, scope)     # exact: can_allocate said both fit
            m.mark_computed(sid, tokens)
            ops = m.take_ops()
            self._evicted(ops)
            m._ops.extend(before + ops)
            self.live[sid] = tokens
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None and self.live)
    @rule(data=st.data(), n=st.integers(1, 6), commit=st.booleans())
    def append(self, data, n, commit):
        m = self.m
        sid = data.draw(st.sampled_from(sorted(self.live)))
        if self.live[sid] + n > self.max_tokens:
            return
        if not m.can_append(sid, n):
            self._still_refused(lambda: m.can_append(sid, n))
            return

        def change():
            m.append(sid, n)
            self.live[sid] += n
        self._kv(change, commit)

    @precondition(lambda self: self.m is not None and self.live)
    @rule(data=st.data(), commit=st.booleans())
    def fork(self, data, commit):
        m = self.m
        sid = data.draw(st.sampled_from(sorted(self.live)))
        if not m.can_fork(sid):
            return
        child = self.next_id
        self.next_id += 1

        def change():
            m.fork(sid, child)
            self.live[child] = self.live[sid]
        self._kv(change, commit)

    @precondition(lambda self: self.m is not None and self.live)
    @rule(data=st.data(), commit=st.booleans())
    def free(self, data, commit):
        m = self.m
        sid = data.draw(st.sampled_from(sorted(self.live)))

        def go():
            m.free(sid, computed_tokens=self.live.pop(sid))
            ref = self.seq_adapter.pop(sid, None)
            if ref is not None:                     # every sequence end releases its pin
                m.release_adapter(ref)
                self.uses[ref.digest] -= 1
                if not self.uses[ref.digest]:
                    self.idle.append(ref.digest)
            assert not any(type(op) in (LoadAdapter, EvictAdapter) for op in m._ops)
        self._txn(go, commit)

    @precondition(lambda self: self.m is not None and self.vmem and self.m._adapters_share_kv)
    @rule(slices=st.integers(0, 11), commit=st.booleans())
    def resize(self, slices, commit):
        m = self.m
        target = min(slices * self.slice_bytes, m.max_cache_bytes)

        def change():
            short = m.resize(target)
            if short:        # left: what sequences and pinned adapters hold, nothing idle
                assert not m._idle_adapters and not m._reclaimable and not len(m._cache)
        self._kv(change, commit)

    # -- invariants --
    @invariant()
    def accounted_once(self):
        m = self.m
        if m is None:
            return
        m.check_integrity()
        kv = m.ledger if self.vmem else m._ledger
        tenants = kv.tenants()
        adapters = {("adapter", d) for d in self.uses}
        kv_names = {k.name for k in m.kinds} if self.vmem else set(range(len(m.groups)))
        kv_pages = sum(c for t, c in tenants.items() if t in kv_names)
        adapter_pages = sum(c for t, c in tenants.items() if t in adapters)
        assert kv.free_pages + kv_pages + (adapter_pages if m._adapters_share_kv else 0) + \
            tenants.get(RELEASED, 0) == kv.num_pages, "every page once"
        stats = m.adapter_stats()
        assert stats.pages == sum(m.adapter_pages(a.num_bytes) for a in self.adapters
                                  if a.digest in self.uses)
        assert {d: m.adapter_uses(a) for a in self.adapters for d in [a.digest]
                if d in self.uses} == self.uses
        assert list(m._idle_adapters) == self.idle, "idle in LRU order"
        assert (stats.resident, stats.idle, stats.loads, stats.evictions) == \
            (len(self.uses), len(self.idle), self.loads, self.evictions)
        assert {d: p for d, (p, _) in m.resident_adapters().items()} == self.replica.adapter_pages
        assert {s: m.num_tokens(s) for s in self.live} == self.live
        for sid, ref in self.seq_adapter.items():
            assert sid in self.live and self.uses[ref.digest] >= 1


TestAdapterTenants = AdapterMachine.TestCase
TestAdapterTenants.settings = settings(max_examples=examples(160), stateful_step_count=35,
                                       deadline=None)
