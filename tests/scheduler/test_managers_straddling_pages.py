"""Pages that do not hold whole tokens (issue 17 item 1): a page-group member spans the fewest
consecutive pages that do, so every model builds a vmem manager on every page size.

The vmem state machine (shadow model, read-back, transactions, prefix sharing and forks) runs
on 3-byte tokens with 4- and 5-byte pages; the geometry is checked against hand-worked
numbers for real models on 2 MiB pages, and left unchanged wherever a page holds whole tokens.
"""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from vmemkv.scheduler.geometry import MiB, PageGeometry
from vmemkv.scheduler.managers import VmemManager, make_manager
from vmemkv.scheduler.presets import ModelSpec

from .shadow import VmemMemory
from .test_managers_state_machine import _SETTINGS, CollidingDigests, VmemMachine

THREE_BYTES = ModelSpec("t3", 1, 3, 1, 1, weight_bytes=0)         # per-layer: 3 bytes per token
THREE_LAYERS = ModelSpec("t3i", 3, 1, 1, 1, weight_bytes=0)       # interleaved: 3 bytes per token


class StraddlingVmemMachine(VmemMachine):
    """VmemMachine whose 3-byte tokens straddle pages of 4 or 5 bytes (3 pages a member)."""

    @initialize(interleaved=st.booleans(), page_bytes=st.sampled_from([4, 5]),
                pages=st.integers(1, 6), groups=st.integers(1, 12),
                slots=st.sampled_from([None, 1, 3, 6]), swap=st.integers(0, 64))
    def setup(self, interleaved, page_bytes, pages, groups, slots, swap):
        model = THREE_LAYERS if interleaved else THREE_BYTES
        layout = "interleaved" if interleaved else "per-layer"
        tpp = page_bytes                  # 3 pages of page_bytes hold page_bytes 3-byte tokens
        self.unit = tpp
        self.m = VmemManager(model, groups * 6 * page_bytes, pages * tpp, page_bytes=page_bytes,
                             layout=layout, max_slots=slots, swap_bytes=6 * swap)
        assert (self.m.tokens_per_page, self.m.num_groups, self.m.pages_per_group) == (tpp, groups, 6)
        self.mem = VmemMemory(self.m)


class CollidingStraddlingVmemMachine(CollidingDigests, StraddlingVmemMachine):
    pass


TestVmemOnStraddlingPagesMatchesShadow = StraddlingVmemMachine.TestCase
TestVmemOnStraddlingPagesMatchesShadow.settings = _SETTINGS
TestVmemOnStraddlingPagesWithCollidingDigestsReadsBack = CollidingStraddlingVmemMachine.TestCase
TestVmemOnStraddlingPagesWithCollidingDigestsReadsBack.settings = _SETTINGS


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


def test_manager_on_non_dividing_2mib_pages_counts_groups_of_whole_tokens():
    model = ModelSpec("hd80", 32, 8, 80, 2, weight_bytes=0)
    group_bytes = 32 * 2 * 5 * 2 * MiB                       # 64 members x 5 pages
    m = make_manager("vmem", model, 3 * group_bytes, 16384, page_bytes=2 * MiB)
    assert (m.tokens_per_page, m.pages_per_group, m.num_groups) == (8192, 320, 3)
    m.allocate(1, 8193)
    assert m.stats().allocated_tokens == 2 * 8192 and m.pages_per_map_op == 320
