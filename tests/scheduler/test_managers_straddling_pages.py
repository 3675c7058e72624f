"""Pages that do not hold whole tokens (issue 17 item 1): a page-group member spans the fewest
consecutive pages that do, so every model builds a vmem manager on every page size, and a group
is backed only by the pages its tokens' bytes need (VmemManager's BYTES backing rule).

The vmem state machine (shadow model, read-back, transactions, prefix sharing and forks) runs
on 3-byte tokens with 4- and 5-byte pages; its shadow replays every MapExtent and checks that
each token is written and read only inside backed pages, that the pages bound equal the
shadow's page for page, and that an unshared sequence holds members x ceil(tokens x 3 /
page_bytes) pages. The geometry is checked against hand-worked numbers for real models on 2 MiB
pages, and left unchanged wherever a page holds whole tokens.
"""
import dataclasses

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import initialize, invariant

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.geometry import MiB, PageGeometry
from vmemkv.scheduler.layout import PoolBacking
from vmemkv.scheduler.managers import CopyExtent, UnmapExtent, make_manager
from vmemkv.scheduler.presets import ModelSpec

from .shadow import VmemMemory, ref_count
from .test_managers_state_machine import _SETTINGS, EVICTION, CollidingDigests, VmemMachine
from .test_window_state_machine import WindowMachine, WindowMemory
from ..hypothesis_budget import examples

THREE_BYTES = ModelSpec("t3", 1, 3, 1, 1, weight_bytes=0)         # per-layer: 3 bytes per token
THREE_LAYERS = ModelSpec("t3i", 3, 1, 1, 1, weight_bytes=0)       # interleaved: 3 bytes per token


class StraddlingVmemMachine(VmemMachine):
    """VmemMachine whose 3-byte tokens straddle pages of 4 or 5 bytes (3 pages a member), each
    group backed by the pages its bytes need."""

    @initialize(interleaved=st.booleans(), page_bytes=st.sampled_from([4, 5]),
                pages=st.integers(1, 6), slices=st.integers(1, 30),      # a group: 3 slices
                slots=st.sampled_from([None, 1, 3, 6]), swap=st.integers(0, 64), evict=EVICTION)
    def setup(self, interleaved, page_bytes, pages, slices, slots, swap, evict):
        model = THREE_LAYERS if interleaved else THREE_BYTES
        layout = "interleaved" if interleaved else "per-layer"
        tpp = page_bytes                  # 3 pages of page_bytes hold page_bytes 3-byte tokens
        self.unit = tpp
        self.m = make_manager("vmem", model, slices * 2 * page_bytes, pages * tpp,
                              page_bytes=page_bytes, layout=layout, max_slots=slots,
                              swap_bytes=6 * swap, prefix_eviction=evict)
        assert self.m.backing is PoolBacking.BYTES
        assert (self.m.tokens_per_page, self.m.num_groups, self.m.pool_pages) == (tpp, slices, 2 * slices)
        self.mem = VmemMemory(self.m)

    def end_waste(self):
        """Room in the held groups' backed pages past their tokens."""
        fill, u = {}, self.unit
        for sid, s in self.live.items():
            for k, g in enumerate(self.tables(sid)):
                fill[g] = min(u, s.num_tokens - k * u)
        pages = sum(backed(self.m, self.mem).get(g, 0) for g in fill)
        return max(self.m.geometry.tokens_in_member_pages(pages) - sum(fill.values()), 0)

    @invariant()
    def address_space_matches_and_allocated_is_mapped(self):
        """Pages bound are the shadow's page for page; an unshared sequence holds the pages
        covering its bytes, no more."""
        if self.m is None:
            return
        m, mem, geo = self.m, self.mem, self.m.geometry
        mem.check_mapped()
        held = backed(m, mem)
        assert sum(held.values()) * geo.num_members == m.bound_pages
        assert m.stats().allocated_tokens == geo.tokens_in_member_pages(sum(held.values()))
        for sid, s in self.live.items():
            groups = self.tables(sid)
            if all(ref_count(m, g) == 1 for g in groups):
                pages = -(-s.num_tokens * geo.token_bytes // geo.page_bytes)
                assert sum(held[g] for g in groups) == pages, (sid, s.num_tokens)


def backed(m, mem) -> dict:
    """{group: member pages backed} of every group with pages, after checking that each place
    the shadow maps a group holds exactly its backed pages (the ops' pool pages)."""
    n = m.geometry.num_members
    for slot in range(m.num_slots):
        for pi, g in m.mapped_pages(slot).items():
            extent = mem.aspace.get((slot, pi), {}).get(m.kinds[0].name, ())
            assert len(extent) == m.table.backed(0, g) * n, (slot, pi, g)
    return {g: m.table.backed(0, g) for g in range(m.num_groups) if m.table.backed(0, g)}


class CollidingStraddlingVmemMachine(CollidingDigests, StraddlingVmemMachine):
    pass


class StraddlingWindowMachine(WindowMachine):
    """Every layer windowed, on straddling pages: a group given back behind the window is
    unmapped and, once nobody maps it, its pages go back to the ledger (no op)."""

    @initialize(interleaved=st.booleans(), page_bytes=st.sampled_from([4, 5]),
                pages=st.integers(2, 6), slices=st.integers(3, 30),
                slots=st.sampled_from([None, 1, 3, 6]), swap=st.integers(0, 64),
                window=st.integers(1, 9))
    def setup(self, interleaved, page_bytes, pages, slices, slots, swap, window):
        layers = 3 if interleaved else 1
        model = ModelSpec("w3", layers, 3 // layers, 1, 1, weight_bytes=0,
                          layer_windows=(window,) * layers)
        self.unit, self.window = page_bytes, window
        self.m = make_manager("vmem", model, slices * 2 * page_bytes, pages * page_bytes,
                              page_bytes=page_bytes, max_slots=slots, swap_bytes=6 * swap,
                              layout="interleaved" if interleaved else "per-layer")
        assert self.m.backing is PoolBacking.BYTES and self.m.window_tokens == window
        self.mem = WindowMemory(self.m)

    def check_given_back(self, sid, old, behind, ops):
        unmaps = [op for op in ops if isinstance(op, UnmapExtent)]
        assert all(isinstance(op, UnmapExtent) and op.first_page == 0 for op in ops), ops
        assert sorted(op.page_index for op in unmaps) == list(range(old, behind)), ops
        assert all(op.slot == self.m.slot_of(sid) for op in unmaps)
        self.mem.replay(ops, self.live)

    def end_waste(self):
        fill, u = {}, self.unit
        for sid, s in self.live.items():
            lo = self.mem.first.get(sid, 0) // u
            for k, g in enumerate(self.tables(sid), start=lo):
                fill[g] = min(u, s.num_tokens - k * u)
        pages = sum(backed(self.m, self.mem).get(g, 0) for g in fill)
        return max(self.m.geometry.tokens_in_member_pages(pages) - sum(fill.values()), 0)

    @invariant()
    def address_space_matches_and_allocated_is_mapped(self):
        """Pages bound, and the tokens they count as allocated, are the shadow's."""
        if self.m is not None:
            self.mem.check_mapped()
            pages, geo = sum(backed(self.m, self.mem).values()), self.m.geometry
            assert pages * geo.num_members == self.m.bound_pages
            assert self.m.stats().allocated_tokens == geo.tokens_in_member_pages(pages)


TestVmemOnStraddlingPagesMatchesShadow = StraddlingVmemMachine.TestCase
TestVmemOnStraddlingPagesMatchesShadow.settings = _SETTINGS
TestVmemOnStraddlingPagesWithCollidingDigestsReadsBack = CollidingStraddlingVmemMachine.TestCase
TestVmemOnStraddlingPagesWithCollidingDigestsReadsBack.settings = _SETTINGS
TestWindowedVmemOnStraddlingPagesMatchesShadow = StraddlingWindowMachine.TestCase
TestWindowedVmemOnStraddlingPagesMatchesShadow.settings = settings(
    _SETTINGS, max_examples=examples(60))


def _bytes(kv_heads, head_dim, dtype_bytes=2):
    return kv_heads * head_dim * dtype_bytes


@pytest.mark.parametrize("layout, layers, layer_bytes, members_pages, tokens", [
    ("per-layer", 32, _bytes(8, 80), 5, 8192),        # head_dim 80: 1280 B = 2^8 * 5
    ("per-layer", 32, _bytes(8, 96), 3, 4096),        # head_dim 96: 1536 B = 2^9 * 3
    ("per-layer", 32, _bytes(3, 128), 3, 8192),       # 3 KV heads: 768 B = 2^8 * 3
    ("per-layer", 32, _bytes(5, 128), 5, 8192),
    ("per-layer", 32, _bytes(6, 128), 3, 4096),
    ("interleaved", 28, _bytes(8, 128), 7, 256),      # 28 layers: 57344 B = 2^13 * 7
    ("interleaved", 40, _bytes(8, 128), 5, 128),
    ("interleaved", 40, _bytes(8, 80), 25, 1024),
])
def test_two_mib_pages_build_for_every_model_with_whole_tokens_per_group(
        layout, layers, layer_bytes, members_pages, tokens):
    geometry = PageGeometry(layout, 2 * MiB, layers, layer_bytes)
    assert (geometry.pages_per_member, geometry.tokens_per_page) == (members_pages, tokens)
    assert geometry.tokens_per_page * geometry.token_bytes == members_pages * 2 * MiB
    assert geometry.pages_per_group == geometry.num_members * members_pages
    assert not geometry.exact


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_dividing_pages_keep_one_page_per_member(layout):
    geometry = PageGeometry(layout, 2 * MiB, 32, _bytes(8, 128))
    assert geometry.exact and geometry.pages_per_member == 1
    assert geometry.pages_per_group == (64 if layout == "per-layer" else 2)
    assert geometry.tokens_per_page == (1024 if layout == "per-layer" else 32)


def test_phi2_geometry_on_2mib_pages_holds_the_pages_of_its_bytes_not_whole_groups():
    """32 layers x 32 KV heads x 80 fp16 (5,120 bytes a layer-token): a group of 64 members x 5
    pages holds 2,048 tokens; 500 tokens need 64 x ceil(500 x 5120 / 2 MiB) = 128 pages
    (256 MiB), where whole groups pinned 320 (640 MiB)."""
    model = ModelSpec("phi-2-like", 32, 32, 80, 2, weight_bytes=0)
    group_bytes = 64 * 5 * 2 * MiB
    m = make_manager("vmem", model, 3 * group_bytes, 4096, page_bytes=2 * MiB)
    assert m.backing is PoolBacking.BYTES
    assert (m.tokens_per_page, m.pages_per_group, m.pool_pages) == (2048, 320, 960)
    m.allocate(1, 500)
    assert m.bound_pages == 128 and m.stats().allocated_bytes <= 128 * 2 * MiB
    m.append(1, 2048)                              # 2,548 tokens: a whole group and 2 pages
    assert m.bound_pages == 64 * (5 + 2)
    assert m.pages_per_group * 2 * MiB == group_bytes             # what a whole group held
    assert m.max_sequence_tokens == 4096 and m.num_slots == 15
    small = make_manager("vmem", model, 3 * 64 * 2 * MiB, 4096, page_bytes=2 * MiB)
    assert small.max_sequence_tokens == 3 * 2 * MiB // 5120   # 3 slices: less than a group
    exact = make_manager("vmem", ModelSpec("hd128", 32, 8, 128, 2, weight_bytes=0), 2**30, 4096)
    assert exact.backing is PoolBacking.WHOLE                    # pages hold whole tokens
    with pytest.raises(ConfigError, match=r"a bytes pool needs pages that hold no whole token; "
                                          r"got 1 page"):
        dataclasses.replace(exact.layout(), backing=PoolBacking.BYTES)
    with pytest.raises(ConfigError, match=r"holds no page slice \(a page of each member\) of "
                                          r"134217728 bytes"):
        make_manager("vmem", model, 64 * 2 * MiB - 1, 4096, page_bytes=2 * MiB)


def test_a_copy_on_write_of_a_byte_mapped_group_is_charged_the_pages_it_moves():
    """The phi-2-like geometry above: a fork's writer copies the shared partial group, whose
    500 tokens sit on 2 pages of each of its 64 members, so the copy moves 128 x 2 MiB, not the
    320 pages of a whole group the simulator used to charge (2.5x)."""
    model = ModelSpec("phi-2-like", 32, 32, 80, 2, weight_bytes=0)
    m = make_manager("vmem", model, 3 * 64 * 5 * 2 * MiB, 4096, page_bytes=2 * MiB)
    m.allocate(0, 500)
    m.fork(0, 1)
    m.take_ops()
    m.append(1)                                   # the child writes into the shared group
    (copy,) = [op for op in m.take_ops() if isinstance(op, CopyExtent)]
    assert copy.num_tokens is None and copy.member_pages == 2
    assert m.copied_bytes([copy]) == 2 * 64 * 2 * MiB
    assert m.pages_per_group * 2 * MiB == 2.5 * m.copied_bytes([copy])   # the whole group


def test_every_byte_mapped_field_is_covered_by_the_journal():
    """Backing, slices bound and reclaimable slices roll back with the rest (the machines
    above compare whole dumps after rollback; this names a field that would escape)."""
    m = make_manager("vmem", THREE_BYTES, 30 * 2 * 4, 24, page_bytes=4)
    m.allocate(0, 5)
    m.free(0)
    assert m.journal_gaps() == []
    m._new_backing = [0]
    assert m.journal_gaps() == ["_new_backing"]
