"""Exact prefix hits of paged hybrids (vLLM v1's hybrid allocator): a hit of h blocks is served
by every block group: the full groups' blocks 0..h-1 and each windowed group's blocks holding
the last ``window`` tokens before the hit's end (the blocks behind are None in its table, as
the window give-back leaves them). Each group's blocks are registered apart; the integrity
check accounts every block of every group exactly once."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vmemkv.scheduler.errors import OutOfCapacityError, RequestTooLargeError
from vmemkv.scheduler.managers import EVICTION_POLICIES, PagedManager, prefix
from vmemkv.scheduler.managers.ops import SwapIn, SwapOut
from vmemkv.scheduler.managers.window import WindowSwapError
from vmemkv.scheduler.managers.prefix import prefix_scope
from vmemkv.scheduler.presets import ModelSpec

from ..hypothesis_budget import examples
from .shadow import dump
from .test_managers_state_machine import position_only_digest

# Gemma 2's pattern: local (window 6), global, alternating -> groups (1,) full, (0,) window
GEMMA2_LIKE = ModelSpec("g2", 2, 1, 1, 1, weight_bytes=0, layer_windows=(6, None))
BS = 4


def manager(blocks=64, **kw):
    m = PagedManager(GEMMA2_LIKE, blocks * BS * 2 * 1 * 1, 64, block_size_tokens=BS, **kw)
    assert [g.window_tokens for g in m.groups] == [None, 6]
    return m


def serve(m, sid, ids, namespace=None, window=True):
    """Allocate, compute the prompt (publish), slide the window as the scheduler would."""
    hit = m.allocate(sid, len(ids), ids, namespace)
    m.mark_computed(sid, len(ids))
    if window:
        m.release_behind_window(sid, len(ids))
    m.check_integrity()
    return hit


PROMPT = list(range(100, 122))      # 22 tokens: 5 full blocks


def test_a_second_request_with_the_same_prompt_hits_every_group():
    m = manager()
    assert serve(m, 0, PROMPT, window=False) == 0
    full0, win0 = m.block_tables(0)
    m.release_behind_window(0, len(PROMPT))
    # the windowed group gave back its blocks wholly behind token 22 - 6 + 1 = 17 (cached:
    # registered, held by nobody)
    assert m.block_tables(0)[1][:4] == [None] * 4
    assert set(win0[:4]) <= set(m.cached_units())
    m.free(0)
    m.check_integrity()
    hit = m.allocate(1, len(PROMPT), PROMPT)
    m.check_integrity()
    # at most 21 // 4 = 5 blocks (a hit never covers the last token); the window of a hit
    # ending at token 20 reads from token 15: the windowed group needs its blocks 3 and 4
    assert hit == 5 * BS and m.prefix_hits == hit
    full1, win1 = m.block_tables(1)
    assert full1[:5] == full0[:5]                       # the full group's blocks shared
    assert win1[:3] == [None] * 3                       # behind the window: absent
    assert win1[3:5] == win0[3:5]                       # the window's blocks shared
    assert None not in full1 + win1[3:] and len(win1) == 6
    assert set(win0[:3]) <= set(m.cached_units())       # not held: still cached
    m.free(1)
    m.check_integrity()


def test_the_hit_is_cut_back_until_the_window_groups_blocks_are_there():
    m = manager()
    serve(m, 0, PROMPT, window=False)
    full0, win0 = m.block_tables(0)
    m.free(0)
    # evict the window group's block 4 (as the policy would): the full group still has 0..4
    b = win0[4]
    m._cache.remove(b)
    m.prefix.drop(b)
    m._unheld(b)
    m.check_integrity()
    hit = m.allocate(1, len(PROMPT), PROMPT)
    m.check_integrity()
    # a hit of 5 needs window blocks 3, 4 (tokens 15..19): cut to 4, which needs blocks 2, 3
    assert hit == 4 * BS
    full, win = m.block_tables(1)
    assert full[:4] == full0[:4] and full[4] != full0[4]
    assert win[:2] == [None, None] and win[2:4] == win0[2:4]
    assert None not in win[4:] and len(win) == 6
    assert win0[0] in m.cached_units() and win0[1] in m.cached_units()   # not held by seq 1


def test_no_window_blocks_no_hit():
    m = manager(prefix_eviction="off")
    serve(m, 0, PROMPT)
    m.release_behind_window(0, 100)     # give back all but the last window block
    _, win = m.block_tables(0)
    assert win[:-1] == [None] * (len(win) - 1)
    # blocks 0..4 of the window group are gone: a hit of h needs block h-1 at least; only
    # the partial last block is kept (not registered): no hit
    assert m.allocate(1, len(PROMPT), PROMPT) == 0
    m.check_integrity()


@pytest.mark.parametrize("other", [dict(namespace="salted"),
                                   dict(namespace=prefix_scope(None, "salt")),
                                   dict(namespace=prefix_scope(None, None, "adapter-digest"))])
def test_another_cache_salt_or_adapter_gets_no_hit(other):
    m = manager()
    serve(m, 0, PROMPT)
    m.free(0)
    assert serve(m, 1, PROMPT, **other) == 0


def test_a_prompt_shorter_than_one_block_gets_no_hit():
    m = manager()
    serve(m, 0, PROMPT[:3])
    m.free(0)
    assert serve(m, 1, PROMPT[:3]) == 0
    serve(m, 2, PROMPT[:4])       # one full block, but a hit never covers the last token
    m.free(2)
    assert serve(m, 3, PROMPT[:4]) == 0
    assert serve(m, 4, PROMPT[:5]) == BS


def test_a_block_of_one_group_never_serves_another():
    m = manager()
    serve(m, 0, PROMPT, window=False)
    m.free(0)
    hit = m.allocate(1, len(PROMPT), PROMPT)
    full, win = m.block_tables(1)
    for g, table in enumerate((full, win)):
        for b in table[:hit // BS]:
            if b is not None:
                assert m.prefix.by_unit[b].group == g == m._ledger.holder(b)
    m.check_integrity()


def test_eviction_takes_cached_blocks_of_both_groups():
    m = manager(blocks=14)
    serve(m, 0, PROMPT)      # 6 blocks a group
    m.free(0)
    m.check_integrity()
    assert len(m.cached_units()) == 10 and m._ledger.free_pages == 4   # partial blocks: free
    serve(m, 1, list(range(500, 522)))     # needs 12 blocks: four free, eight evicted
    assert len(m.cached_units()) == 2 + 4     # and seq 1's window blocks behind its window
    m.check_integrity()
    with pytest.raises(OutOfCapacityError):
        m.allocate(2, 22, list(range(900, 922)))
    m.check_integrity()


# -- a state machine: shared prompts, append, fork, free, evict, rollback; every hit's blocks
#    hold the prompt's exact ids (a shadow of each block's content by group) --

BASES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1] * 2, [2, 0] * 16]
MODELS = {
    "gemma2": ModelSpec("g2", 2, 1, 1, 1, weight_bytes=0, layer_windows=(6, None)),
    "gemma3": ModelSpec("g3", 6, 1, 1, 1, weight_bytes=0, layer_windows=(3, 3, 3, 3, 3, None)),
    "two-windows": ModelSpec("w2", 2, 1, 1, 1, weight_bytes=0, layer_windows=(2, 9)),
    # a window longer than most sequences: blocks are still all there when one is swapped
    "gemma2-wide": ModelSpec("g2w", 2, 1, 1, 1, weight_bytes=0, layer_windows=(40, None)),
}


HITS = []   # (how many allocations hit: a coverage probe)


class PagedHybridPrefixMachine(RuleBasedStateMachine):
    """Shadow: for every block, per group, the token ids it holds (written by the sequence that
    took it); every live sequence's table must read back its own ids wherever not None."""

    def __init__(self):
        super().__init__()
        self.m = None
        self.live = {}        # seq id -> ids
        self.content = {}     # block -> ids written (the holding sequence's tokens)
        self.computed = {}    # seq id -> tokens computed (published)
        self.swapped = {}     # seq id -> (ids, computed): in host swap space
        self.next_id = 0
        self.txn = None

    @initialize(model=st.sampled_from(sorted(MODELS)), evict=st.sampled_from(EVICTION_POLICIES),
                blocks=st.integers(16, 64), bs=st.sampled_from([1, 2, 3]))
    def start(self, model, evict, blocks, bs):
        spec = MODELS[model]
        self.m = PagedManager(spec, blocks * bs * 2 * 1, 48, block_size_tokens=bs,
                              prefix_eviction=evict, swap_bytes=60 * spec.bytes_per_token)
        self.bs = bs

    def _write(self, sid, start, end):
        """The content of each of sid's blocks covering [start, end) after a write."""
        ids = self.live[sid]
        for table in self.m.block_tables(sid):
            for k in range(start // self.bs, -(-end // self.bs)):
                b = table[k]
                if b is not None:
                    self.content[b] = tuple(ids[k * self.bs:min(end, (k + 1) * self.bs)])

    @rule(base=st.integers(0, 1), plen=st.integers(1, 30), tail=st.lists(st.integers(0, 3),
          max_size=2), ns=st.sampled_from([None, None, "a"]))
    @precondition(lambda self: self.m is not None)
    def allocate(self, base, plen, tail, ns):
        ids = BASES[base][:plen] + tail
        sid = self.next_id
        if not self.m.can_allocate(len(ids), ids, ns):
            with pytest.raises((OutOfCapacityError, RequestTooLargeError)):
                self.m.allocate(sid, len(ids), ids, ns)
            return
        self.next_id += 1
        hit = self.m.allocate(sid, len(ids), ids, ns)
        HITS.append(hit)
        assert hit % self.bs == 0 and hit < len(ids)
        self.live[sid] = list(ids)
        # every hit block holds exactly the prompt's ids (computed by an earlier sequence)
        for g, table in enumerate(self.m.block_tables(sid)):
            for k, b in enumerate(table[:hit // self.bs]):
                if b is not None:
                    assert self.content[b] == tuple(ids[k * self.bs:(k + 1) * self.bs]), (g, k)
                    assert self.m._ledger.holder(b) == g
        window = self.m.groups
        for g, table in enumerate(self.m.block_tables(sid)):
            w = window[g].window_tokens
            need = 0 if w is None or not hit else max(hit - w + 1, 0) // self.bs
            assert table[:need] == [None] * need and None not in table[need:]
        self._write(sid, hit, len(ids))
        self.computed[sid] = hit

    def pick(self, i):
        return sorted(self.live)[i % len(self.live)]

    @rule(i=st.integers(0, 99))
    @precondition(lambda self: self.live)
    def compute(self, i):
        sid = self.pick(i)
        n = self.m.num_tokens(sid)
        self.m.mark_computed(sid, n)
        self.computed[sid] = n
        if self.m.window_tokens:
            self.m.release_behind_window(sid, n)

    @rule(i=st.integers(0, 99), toks=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    @precondition(lambda self: self.live)
    def append(self, i, toks):
        sid = self.pick(i)
        if self.computed[sid] < self.m.num_tokens(sid) or not self.m.can_append(sid, len(toks)):
            return
        old = self.m.num_tokens(sid)
        self.m.append(sid, len(toks), toks)
        self.live[sid].extend(toks)
        self._write(sid, old, old + len(toks))

    @rule(i=st.integers(0, 99))
    @precondition(lambda self: self.live)
    def fork(self, i):
        sid = self.pick(i)
        child = self.next_id
        self.next_id += 1
        self.m.fork(sid, child)
        self.live[child] = list(self.live[sid])
        self.computed[child] = self.computed[sid]

    @rule(i=st.integers(0, 99), all_computed=st.booleans())
    @precondition(lambda self: self.live)
    def free(self, i, all_computed):
        sid = self.pick(i)
        self.m.free(sid, None if all_computed else self.computed[sid])
        del self.live[sid]

    @rule(i=st.integers(0, 99))
    @precondition(lambda self: self.live)
    def swap_out(self, i):
        """Every group's blocks, group after group; refused once a window gave blocks back."""
        sid = self.pick(i)
        tables = self.m.block_tables(sid)
        if any(None in table for table in tables):
            assert not self.m.can_swap_out(sid)
            with pytest.raises(WindowSwapError):
                self.m.swap_out(sid)
            assert self.m.block_tables(sid) == tables
            return
        if not self.m.can_swap_out(sid):
            return
        self.m.take_ops()
        self.m.swap_out(sid)
        op = [o for o in self.m.take_ops() if isinstance(o, SwapOut)][0]
        assert op.blocks == tuple(b for table in tables for b in table)
        self.swapped[sid] = (self.live.pop(sid), self.computed.pop(sid))

    @rule(i=st.integers(0, 99))
    @precondition(lambda self: self.swapped)
    def swap_in(self, i):
        sid = sorted(self.swapped)[i % len(self.swapped)]
        if not self.m.can_swap_in(sid):
            return
        self.m.take_ops()
        self.m.swap_in(sid)
        op = [o for o in self.m.take_ops() if isinstance(o, SwapIn)][0]
        tables = self.m.block_tables(sid)
        assert op.blocks == tuple(b for table in tables for b in table) and None not in op.blocks
        self.live[sid], self.computed[sid] = self.swapped.pop(sid)
        self._write(sid, 0, len(self.live[sid]))     # the SwapIn writes the tokens back

    @rule()
    @precondition(lambda self: self.m is not None)
    def reset(self):
        self.m.reset_prefix_cache()

    @rule()
    @precondition(lambda self: self.m is not None and self.txn is None)
    def begin(self):
        self.state = dump(self.m)
        self.m.begin()
        self.txn = ({s: list(t) for s, t in self.live.items()}, dict(self.content),
                    dict(self.computed), self.next_id,
                    {s: (list(ids), c) for s, (ids, c) in self.swapped.items()},
                    {s: self.m.block_tables(s) for s in self.live}, sorted(self.m.cached_units()))

    @rule(keep=st.booleans())
    @precondition(lambda self: self.txn is not None)
    def end(self, keep):
        if keep:
            self.m.commit()
        else:
            self.m.rollback()
            live, content, computed, nid, swapped, tables, cached = self.txn
            self.live, self.content, self.computed, self.next_id = live, content, computed, nid
            self.swapped = swapped
            assert {s: self.m.block_tables(s) for s in self.live} == tables
            assert sorted(self.m.cached_units()) == cached
            assert dump(self.m) == self.state, "a rollback left a change"
        self.txn = None

    @invariant()
    def integrity_and_reads_back(self):
        if self.m is None:
            return
        self.m.check_integrity()
        for sid, ids in self.live.items():
            for table in self.m.block_tables(sid):
                for k, b in enumerate(table):
                    if b is not None:
                        end = min(len(ids), (k + 1) * self.bs)
                        assert self.content[b] == tuple(ids[k * self.bs:end]), (sid, k, b)

    def teardown(self):
        if self.m is not None and self.txn is not None:
            self.m.rollback()


class CollidingPagedHybridPrefixMachine(PagedHybridPrefixMachine):
    def __init__(self):
        super().__init__()
        self._real = prefix.unit_digest
        prefix.unit_digest = position_only_digest

    def teardown(self):
        prefix.unit_digest = self._real
        super().teardown()


_SETTINGS = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
TestPagedHybridPrefixReadsBack = PagedHybridPrefixMachine.TestCase
TestPagedHybridPrefixReadsBack.settings = _SETTINGS
TestPagedHybridPrefixCollidingDigests = CollidingPagedHybridPrefixMachine.TestCase
TestPagedHybridPrefixCollidingDigests.settings = _SETTINGS


@pytest.mark.parametrize("evict", ["lru", "hits", "off"])
def test_the_scheduler_shares_prefixes_over_a_paged_hybrid(evict):
    """Prefix sharing, forks, preemption by recompute, integrity checked after every step:
    every request ends, later ones hit, and memory comes back."""
    from vmemkv.scheduler.managers import make_manager

    from .test_hybrid_simulation import HYBRID_SPEC, drive_hybrid_workload

    m = make_manager("paged", HYBRID_SPEC, 12 * 2 * 60, 96, block_size_tokens=2,
                     prefix_eviction=evict)
    assert len(m.groups) > 1
    s = drive_hybrid_workload(m, "recompute", True)
    assert s.metrics.num_finished_requests == 30
    assert m.prefix_hits > 0
    assert m.stats().live_tokens == 0
    m.check_integrity()
