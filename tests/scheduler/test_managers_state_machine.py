"""Every manager against a shadow model (hypothesis state machines).

After every step: ``check_integrity()``; stats recomputed from public queries (end waste, live,
allocated, free + allocated == total); for paged and vmem, the emitted ops replayed on a model of
physical memory, every live sequence read back token by token, no write into a shared unit, and
(vmem) the replayed address space equal to ``mapped_pages``. Every refused call (``can_*`` False)
must raise a typed error and leave the manager exactly as it was. Transactions: ``begin`` at any
point, any calls, then ``rollback`` must give back exactly the state at ``begin`` (every field,
the shadow's reads, and the same results for every later call); ``commit`` keeps the changes.
"""
import copy
import hashlib

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vmemkv.scheduler.errors import (OutOfCapacityError, RequestTooLargeError, SlotError,
                              SwapSpaceExhaustedError)
from vmemkv.scheduler.managers import (EVICTION_POLICIES, PagedManager, ReserveManager,
                                       VmemManager, prefix)
from vmemkv.scheduler.presets import ModelSpec

from .shadow import PagedMemory, ShadowSeq, VmemMemory, dump
from ..hypothesis_budget import examples

ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 1 byte per layer-token, 2 per token
TWO_LAYER = ModelSpec("t2", 2, 1, 1, 1, weight_bytes=0)   # interleaved page: 2 bytes per token
BASES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1] * 2, [2, 0] * 16]   # shared prefixes
TOKEN = st.integers(0, 3)
PICK = st.integers(0, 10**6)
EVICTION = st.sampled_from(EVICTION_POLICIES)


def fingerprint(m):
    """Everything observable and every field, for 'a refused call changed nothing'."""
    return [m.stats(), dump(m)]


class ManagerMachine(RuleBasedStateMachine):
    unit = 1            # tokens per block / page (1 for reserve)

    def __init__(self):
        super().__init__()
        self.m, self.mem = None, None
        self.live, self.swapped = {}, {}
        self.next_id = 0
        self.txn = None     # (state dump, shadow) at begin, while a transaction is open

    # -- helpers --
    def pick(self, pool, i):
        return sorted(pool)[i % len(pool)]

    def refused(self, errors, call, *args, **kw):
        before = fingerprint(self.m)
        with pytest.raises(errors):
            call(*args, **kw)
        assert fingerprint(self.m) == before, "a refused call changed state"

    def replay(self, writes=()):
        ops = self.m.take_ops()
        if self.mem is not None:
            self.mem.replay(ops, self.live, writes)
        else:
            assert all(type(op).__name__ in ("SwapOut", "SwapIn", "DropSwapped") for op in ops), ops

    # -- rules --
    @rule(base=st.integers(0, len(BASES) - 1), plen=st.integers(0, 12),
          tail=st.lists(TOKEN, max_size=2), ahead=st.lists(TOKEN, max_size=4),
          ns=st.sampled_from([None, None, "a"]), pass_ids=st.sampled_from([True, True, False]),
          extra=st.integers(0, 8))
    def allocate(self, base, plen, tail, ahead, ns, pass_ids, extra):
        ids = BASES[base][:plen] + tail
        n, sid = len(ids), self.next_id
        token_ids = ids + ahead if pass_ids else None
        final = min(n + extra, self.m.max_seq_len)
        if n > self.m.max_sequence_tokens:
            self.refused(RequestTooLargeError, self.m.allocate, sid, n, token_ids, ns, final)
            return
        if not self.m.can_allocate(n, token_ids, ns, final_tokens=final):
            self.refused(OutOfCapacityError, self.m.allocate, sid, n, token_ids, ns, final)
            return
        self.next_id += 1
        q0, h0 = self.m.prefix_queries, self.m.prefix_hits
        hit = self.m.allocate(sid, n, token_ids, ns, final_tokens=final)
        assert hit % self.unit == 0 and 0 <= hit <= max(n - 1, 0)
        assert (self.m.prefix_queries - q0, self.m.prefix_hits - h0) == ((n, hit) if pass_ids else (0, 0))
        s = ShadowSeq(ids + ahead, ns)
        s.num_tokens = n
        s.reserved = final if self.m.name == "reserve-oracle" else self.m.max_seq_len
        self.live[sid] = s
        self.replay([(sid, hit, n)])

    @precondition(lambda self: self.live and self.m.fork_unit_tokens)
    @rule(i=PICK, k=st.integers(0, 16), tail=st.lists(TOKEN, max_size=6))
    def allocate_sharing_a_sibling(self, i, k, tail):
        """A sample recomputed beside a running sibling (``share_from``): it holds the
        sibling's units of their first k tokens (whole, below its last token), as a fork
        would, and writes only the rest."""
        sib = self.pick(self.live, i)
        k = min(k, self.live[sib].num_tokens)
        ids = self.live[sib].ids[:k] + tail
        n, sid, share = len(ids), self.next_id, (sib, k)
        if not n or n > self.m.max_sequence_tokens:
            return
        if not self.m.can_allocate(n, share_from=share):
            self.refused(OutOfCapacityError, self.m.allocate, sid, n, share_from=share)
            return
        self.next_id += 1
        hit = self.m.allocate(sid, n, share_from=share)
        # all of them, or none where one was given back behind a window (subclasses' slide);
        # the reads below check what is shared
        assert hit in (0, min(k, n - 1) // self.unit * self.unit)
        s = ShadowSeq(ids, self.live[sib].namespace)    # a sibling: the same request's scope
        s.num_tokens, s.reserved = n, self.m.max_seq_len
        self.live[sid] = s
        assert self.tables(sid)[:hit // self.unit] == self.tables(sib)[:hit // self.unit]
        self.replay([(sid, hit, n)])

    @precondition(lambda self: self.live)
    @rule(i=PICK, k=st.integers(0, 3), fresh=st.lists(TOKEN, min_size=3, max_size=3),
          pass_ids=st.booleans())
    def append(self, i, k, fresh, pass_ids):
        sid = self.pick(self.live, i)
        s = self.live[sid]
        n = s.num_tokens
        if len(s.ids) < n + k:
            s.extend_ids(fresh[:n + k - len(s.ids)])
        token_ids = s.ids[n:n + k] if pass_ids else None
        if not self.m.can_append(sid, k):
            errors = RequestTooLargeError if n + k > self.m.max_seq_len else OutOfCapacityError
            self.refused(errors, self.m.append, sid, k, token_ids)
            return
        self.m.append(sid, k, token_ids)
        s.num_tokens += k
        self.replay([(sid, n, n + k)])

    @precondition(lambda self: self.live)
    @rule(i=PICK, k=st.integers(0, 40))
    def mark_computed(self, i, k):
        """A step computed some of a sequence's tokens: its full units among them publish."""
        sid = self.pick(self.live, i)
        self.m.mark_computed(sid, min(k, self.live[sid].num_tokens))
        self.replay()

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def fork(self, i):
        parent, child = self.pick(self.live, i), self.next_id
        if not self.m.can_fork(parent):
            self.refused(OutOfCapacityError, self.m.fork, parent, child)
            return
        self.next_id += 1
        self.m.fork(parent, child)
        self.live[child] = self.live[parent].copy()
        self.replay()

    @precondition(lambda self: self.live)
    @rule(i=PICK, writer_is_child=st.booleans(), fresh=st.lists(TOKEN, min_size=3, max_size=3))
    def fork_then_write(self, i, writer_is_child, fresh):
        """The copy-on-write path: fork, then one of the two sharers writes."""
        parent, child = self.pick(self.live, i), self.next_id
        self.fork(i)
        if child in self.live:
            writer = child if writer_is_child else parent
            self.append(sorted(self.live).index(writer), 1, fresh, True)

    @precondition(lambda self: self.live or self.swapped)
    @rule(i=PICK)
    def free(self, i):
        sid = self.pick(list(self.live) + list(self.swapped), i)
        self.m.free(sid)
        self.live.pop(sid, None)
        self.swapped.pop(sid, None)
        self.replay()          # a swapped one's DropSwapped op drops its host copy

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def swap_out(self, i):
        sid = self.pick(self.live, i)
        if not self.m.can_swap_out(sid):
            self.refused(SwapSpaceExhaustedError, self.m.swap_out, sid)
            return
        if self.mem is not None:
            self.mem.capture(sid)
        assert self.m.swap_out(sid) == self.live[sid].num_tokens
        self.swapped[sid] = self.live.pop(sid)
        self.replay()

    @precondition(lambda self: self.swapped)
    @rule(i=PICK)
    def swap_in(self, i):
        sid = self.pick(self.swapped, i)
        if not self.m.can_swap_in(sid):
            self.refused(OutOfCapacityError, self.m.swap_in, sid)
            return
        self.m.swap_in(sid)
        self.live[sid] = self.swapped.pop(sid)
        self.replay()

    @precondition(lambda self: self.m is not None and self.txn is None)
    @rule()
    def begin(self):
        assert not self.m.in_transaction
        self.m.begin()
        mem = None if self.mem is None else self.mem.save()
        self.txn = (dump(self.m), copy.deepcopy((self.live, self.swapped)), mem)

    @precondition(lambda self: self.txn is not None)
    @rule()
    def commit(self):
        self.m.commit()
        self.txn = None

    @precondition(lambda self: self.txn is not None)
    @rule()
    def rollback(self):
        """Undo every call since begin; sequence ids stay unique (next_id is not reused)."""
        state, shadow, mem = self.txn
        self.m.rollback()
        self.txn = None
        assert not self.m.in_transaction
        assert dump(self.m) == state, "rollback did not restore the state at begin"
        self.live, self.swapped = shadow
        if self.mem is not None:
            self.mem.load(mem)

    # -- invariants --
    @invariant()
    def integrity_and_stats(self):
        if self.m is None:
            return
        m, st_ = self.m, self.m.stats()
        m.check_integrity()
        assert st_.free_tokens + st_.allocated_tokens == st_.total_tokens
        for sid, s in list(self.live.items()) + list(self.swapped.items()):
            assert m.num_tokens(sid) == s.num_tokens
        u = self.unit
        if isinstance(m, ReserveManager):
            held = sum(s.reserved for s in self.live.values())
            assert st_.allocated_tokens == held
            assert st_.live_tokens == sum(s.num_tokens for s in self.live.values())
            assert st_.end_waste_tokens == held - st_.live_tokens
            return
        assert st_.end_waste_tokens == self.end_waste()
        fill = {}
        for sid, s in self.live.items():
            for k, unit in enumerate(self.tables(sid)):
                fill[unit] = min(u, s.num_tokens - k * u)
        assert st_.live_tokens == sum(fill.values())
        self.mem.check_reads(self.live)


    def end_waste(self):
        """Tokens held past the live sequences' ends: whole units each."""
        u = self.unit
        return sum(-(-s.num_tokens // u) * u - s.num_tokens for s in self.live.values())


class ReserveMachine(ManagerMachine):
    @initialize(oracle=st.booleans(), max_len=st.integers(8, 32), slots=st.integers(1, 4),
                swap=st.integers(0, 64))
    def setup(self, oracle, max_len, slots, swap):
        self.m = ReserveManager(ONE_LAYER, 2 * max_len * slots + 2, max_len, oracle=oracle,
                                swap_bytes=2 * swap)


class PagedMachine(ManagerMachine):
    @initialize(bs=st.sampled_from([1, 2, 4, 8]), blocks=st.integers(1, 24),
                max_len=st.integers(4, 40), swap=st.integers(0, 64), evict=EVICTION)
    def setup(self, bs, blocks, max_len, swap, evict):
        self.unit = bs
        self.m = PagedManager(ONE_LAYER, 2 * bs * blocks, max_len, block_size_tokens=bs,
                              swap_bytes=2 * swap, prefix_eviction=evict)
        self.mem = PagedMemory(self.m)

    def tables(self, sid):
        return self.m.block_table(sid)

    @invariant()
    def allocated_is_held_blocks(self):
        if self.m is not None:
            held = self.mem.allocated_blocks(self.live)
            assert self.m.stats().allocated_tokens == len(held) * self.unit


class VmemMachine(ManagerMachine):
    @initialize(interleaved=st.booleans(), tpp=st.sampled_from([1, 2, 4]),
                pages=st.integers(1, 8), groups=st.integers(1, 20),
                slots=st.sampled_from([None, 1, 3, 6, 8]), swap=st.integers(0, 64),
                evict=EVICTION)
    def setup(self, interleaved, tpp, pages, groups, slots, swap, evict):
        model, page_bytes = (TWO_LAYER, 2 * tpp) if interleaved else (ONE_LAYER, tpp)
        layout = "interleaved" if interleaved else "per-layer"
        self.unit = tpp
        self.m = VmemManager(model, groups * 2 * page_bytes, pages * tpp, page_bytes=page_bytes,
                             layout=layout, max_slots=slots, swap_bytes=2 * swap,
                             prefix_eviction=evict)
        assert (self.m.tokens_per_page, self.m.num_groups) == (tpp, groups)
        self.mem = VmemMemory(self.m)

    @rule(slot=st.integers(-1, 8), n=st.integers(0, 6), ids=st.lists(TOKEN, min_size=6, max_size=6))
    def allocate_on_a_chosen_slot(self, slot, n, ids):
        sid = self.next_id
        if n > self.m.max_sequence_tokens:     # the request's size is checked first
            self.refused(RequestTooLargeError, self.m.allocate, sid, n, slot=slot)
            return
        if not 0 <= slot < self.m.num_slots or slot in {self.m.slot_of(s) for s in self.live}:
            self.refused(SlotError, self.m.allocate, sid, n, slot=slot)
            return
        if not self.m.can_allocate(n):
            self.refused(OutOfCapacityError, self.m.allocate, sid, n, slot=slot)
            return
        self.next_id += 1
        assert self.m.allocate(sid, n, slot=slot) == 0 and self.m.slot_of(sid) == slot
        s = ShadowSeq(ids[:n], None)      # token ids not passed: no prefix registration
        s.num_tokens = n
        s.reserved = self.m.max_seq_len
        self.live[sid] = s
        self.replay([(sid, 0, n)])

    def tables(self, sid):
        pages = self.m.mapped_pages(self.m.slot_of(sid))
        return [pages[pi] for pi in range(-(-self.live[sid].num_tokens // self.unit))]

    @invariant()
    def address_space_matches_and_allocated_is_mapped(self):
        if self.m is not None:
            self.mem.check_mapped()
            mapped = {g for slot in range(self.m.num_slots) for g in self.m.mapped_pages(slot).values()}
            groups = mapped | set(self.m.cached_units())
            assert self.m.stats().allocated_tokens == len(groups) * self.unit


def position_only_digest(parent, tokens):
    """A digest that ignores the tokens: every unit at the same position collides."""
    return hashlib.sha256(parent).digest()


class CollidingDigests:
    """Mixed into a machine: every prefix digest collides by position, so only the index's
    verification (token ids and registration chain) keeps sharing exact; the shadow's reads
    catch any unit shared by mistake."""

    def __init__(self):
        super().__init__()
        self._real_digest = prefix.unit_digest
        prefix.unit_digest = position_only_digest

    def teardown(self):
        prefix.unit_digest = self._real_digest


class CollidingPagedMachine(CollidingDigests, PagedMachine):
    pass


class CollidingVmemMachine(CollidingDigests, VmemMachine):
    pass


# 300 examples in CI; more under HYPOTHESIS_PROFILE=long (tests/conftest.py)
_SETTINGS = settings(max_examples=examples(200), stateful_step_count=40,
                     deadline=None)
TestReserveMatchesShadow = ReserveMachine.TestCase
TestReserveMatchesShadow.settings = _SETTINGS
TestPagedMatchesShadowAndReadsBack = PagedMachine.TestCase
TestPagedMatchesShadowAndReadsBack.settings = _SETTINGS
TestVmemMatchesShadowAndReadsBack = VmemMachine.TestCase
TestVmemMatchesShadowAndReadsBack.settings = _SETTINGS
TestPagedWithCollidingDigestsReadsBack = CollidingPagedMachine.TestCase
TestPagedWithCollidingDigestsReadsBack.settings = _SETTINGS
TestVmemWithCollidingDigestsReadsBack = CollidingVmemMachine.TestCase
TestVmemWithCollidingDigestsReadsBack.settings = _SETTINGS
