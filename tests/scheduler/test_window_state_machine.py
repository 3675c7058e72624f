"""The vmem and paged managers with every layer windowed, against the shadow model (hypothesis
state machines): units wholly behind a sequence's window are given back (unheld; vmem: also
unmapped) at any point, together with forks, copy-on-write, prefix sharing (colliding digests included), swap,
recompute frees and transactions.

On top of tests/scheduler/test_managers_state_machine.py's checks (the ops replayed on a model
of physical memory, every live sequence read back, allocated == mapped groups, refused calls
change nothing, rollback restores everything): each sequence reads back exactly its tokens from
the first one its window still holds; each page given back is unmapped from the sequence's slot
(one UnmapExtent per page; deferred-reclamation pages of an earlier occupant may stay mapped
there, as everywhere in vmem) and no longer counts as live; a sequence that gave pages back is never swapped (WindowSwapError, nothing changed); and
no sequence holds a group that lies wholly behind its window.
"""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from vmemkv.scheduler.managers import PagedManager, VmemManager
from vmemkv.scheduler.managers.window import WindowSwapError
from vmemkv.scheduler.presets import ModelSpec

from .shadow import PagedMemory, VmemMemory
from .test_managers_state_machine import (_SETTINGS, PICK, CollidingDigests, PagedMachine,
                                          VmemMachine)


class WindowMemory(VmemMemory):
    """The shadow address space plus, per sequence, the first token its memory still holds."""

    def __init__(self, manager):
        super().__init__(manager)
        self.first = {}        # seq_id -> first token held (a multiple of the unit)

    def check_reads(self, shadow):
        for seq_id, s in shadow.items():
            lo = self.first.get(seq_id, 0)
            slot = self.m.slot_of(seq_id)
            got = [self.pages.get(page, {}).get(offset) for page, offset in
                   (self._page(slot, p) for p in range(lo, s.num_tokens))]
            assert got == s.contents[lo:s.num_tokens], seq_id


class WindowBlocks(PagedMemory):
    """The shadow blocks plus, per sequence, the first token its blocks still hold."""

    def __init__(self, manager):
        super().__init__(manager)
        self.first = {}

    def check_reads(self, shadow):
        bs = self.m.block_size
        for seq_id, s in shadow.items():
            lo, table = self.first.get(seq_id, 0), self.m.block_table(seq_id)
            assert table[:lo // bs] == [None] * (lo // bs), "a block behind the window is held"
            got = [self.blocks.get(table[p // bs], {}).get(p % bs) for p in range(lo, s.num_tokens)]
            assert got == s.contents[lo:s.num_tokens], seq_id

    def allocated_blocks(self, shadow):
        return {b for sid in shadow for b in self.m.block_table(sid) if b is not None}


class WindowRules:
    """The rules and checks both windowed machines add (the manager's ``unit``, ``window``)."""

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def slide(self, i):
        """The next query of a sequence is at its last token: drop what is behind the window."""
        sid = self.pick(self.live, i)
        n = self.live[sid].num_tokens
        self.m.release_behind_window(sid, n)
        behind = max(min(max(n - self.window + 1, 0) // self.unit, -(-n // self.unit) - 1), 0)
        old = self.mem.first.get(sid, 0)
        behind = max(behind, old // self.unit)
        self.mem.first[sid] = behind * self.unit
        self.check_given_back(sid, old // self.unit, behind, self.m.take_ops())
        self.mem.replay([], self.live)

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def fork(self, i):
        parent, child = self.pick(self.live, i), self.next_id
        super().fork(i)
        if child in self.live:
            self.mem.first[child] = self.mem.first.get(parent, 0)

    @precondition(lambda self: self.live)
    @rule(i=PICK)
    def swap_out(self, i):
        sid = self.pick(self.live, i)
        if self.mem.first.get(sid, 0):
            assert not self.m.can_swap_out(sid)
            self.refused(WindowSwapError, self.m.swap_out, sid)
            return
        super().swap_out(i)

    @precondition(lambda self: self.live or self.swapped)
    @rule(i=PICK)
    def free(self, i):
        sid = self.pick(list(self.live) + list(self.swapped), i)
        super().free(i)
        self.mem.first.pop(sid, None)

    @invariant()
    def integrity_and_stats(self):
        if self.m is None:
            return
        m, stats, u = self.m, self.m.stats(), self.unit
        m.check_integrity()
        assert stats.free_tokens + stats.allocated_tokens == stats.total_tokens
        assert stats.end_waste_tokens == self.end_waste()
        fill = {}
        for sid, s in self.live.items():
            lo = self.mem.first.get(sid, 0) // u
            for k, unit in enumerate(self.tables(sid), start=lo):
                fill[unit] = min(u, s.num_tokens - k * u)
        assert stats.live_tokens == sum(fill.values())
        self.mem.check_reads(self.live)


class PagedWindowMachine(WindowRules, PagedMachine):
    @initialize(bs=st.sampled_from([1, 2, 4]), blocks=st.integers(2, 24),
                max_len=st.integers(4, 40), swap=st.integers(0, 64), window=st.integers(1, 9))
    def setup(self, bs, blocks, max_len, swap, window):
        model = ModelSpec("w", 1, 1, 1, 1, weight_bytes=0, layer_windows=(window,))
        self.unit, self.window = bs, window
        self.m = PagedManager(model, 2 * bs * blocks, max_len, block_size_tokens=bs,
                              swap_bytes=2 * swap)
        self.mem = WindowBlocks(self.m)

    def check_given_back(self, sid, old, behind, ops):
        assert ops == [] and self.m.block_table(sid)[:behind] == [None] * behind

    def tables(self, sid):
        return [b for b in self.m.block_table(sid) if b is not None]


class WindowMachine(WindowRules, VmemMachine):
    @initialize(interleaved=st.booleans(), tpp=st.sampled_from([1, 2, 4]),
                pages=st.integers(2, 10), groups=st.integers(2, 24),
                slots=st.sampled_from([None, 1, 3, 6]), swap=st.integers(0, 64),
                window=st.integers(1, 9))
    def setup(self, interleaved, tpp, pages, groups, slots, swap, window):
        layers = 2 if interleaved else 1
        model = ModelSpec("w", layers, 1, 1, 1, weight_bytes=0, layer_windows=(window,) * layers)
        page_bytes = layers * tpp
        self.unit, self.window = tpp, window
        self.m = VmemManager(model, groups * 2 * page_bytes, pages * tpp, page_bytes=page_bytes,
                             layout="interleaved" if interleaved else "per-layer",
                             max_slots=slots, swap_bytes=2 * swap)
        assert self.m.window_tokens == window
        self.mem = WindowMemory(self.m)

    def check_given_back(self, sid, old, behind, ops):
        assert all(type(op).__name__ == "UnmapExtent" for op in ops), ops
        slot = self.m.slot_of(sid)     # each page given back is unmapped from its slot
        assert sorted(op.page_index for op in ops) == list(range(old, behind)), ops
        assert all(op.slot == slot for op in ops)
        self.mem.replay(ops, self.live)

    def tables(self, sid):
        pages, lo = self.m.mapped_pages(self.m.slot_of(sid)), self.mem.first.get(sid, 0) // self.unit
        return [pages[pi] for pi in range(lo, -(-self.live[sid].num_tokens // self.unit))]


class CollidingWindowMachine(CollidingDigests, WindowMachine):
    pass


class CollidingPagedWindowMachine(CollidingDigests, PagedWindowMachine):
    pass


TestWindowedVmemMatchesShadow = WindowMachine.TestCase
TestWindowedVmemMatchesShadow.settings = _SETTINGS
TestWindowedVmemWithCollidingDigests = CollidingWindowMachine.TestCase
TestWindowedVmemWithCollidingDigests.settings = _SETTINGS
TestWindowedPagedMatchesShadow = PagedWindowMachine.TestCase
TestWindowedPagedMatchesShadow.settings = _SETTINGS
TestWindowedPagedWithCollidingDigests = CollidingPagedWindowMachine.TestCase
TestWindowedPagedWithCollidingDigests.settings = _SETTINGS


def test_hybrid_models_keep_every_group():
    """A full-attention layer reads every token: no window to give memory back behind."""
    hybrid = ModelSpec("h", 2, 1, 1, 1, weight_bytes=0, layer_windows=(4, None))
    m = VmemManager(hybrid, 64, 16, page_bytes=1, max_slots=2)
    assert m.window_tokens is None
    m.allocate(0, 12)
    m.release_behind_window(0, 12)
    assert m.take_ops()[-1].__class__.__name__ == "MapExtent" and m.stats().allocated_tokens == 12


def test_model_spec_layer_windows_are_validated():
    from vmemkv.scheduler.errors import ConfigError
    with pytest.raises(ConfigError, match=r"layer_windows must be \(\) or one None / int >= 1"):
        ModelSpec("w", 2, 1, 1, 1, weight_bytes=0, layer_windows=(4,))
    assert ModelSpec("w", 2, 1, 1, 1, weight_bytes=0, layer_windows=(4, 6)).window_tokens == 6
