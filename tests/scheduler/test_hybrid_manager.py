"""The hybrid vmem manager with exact numbers: Gemma 3's layer pattern holds the predicted pages
behind its window, admits the computed larger number of sequences, refuses what it cannot do
with typed errors that change nothing, and leaves every other model on the old path."""
import pytest

from vmemkv.scheduler.errors import ConfigError, OutOfCapacityError
from vmemkv.scheduler.geometry import MiB, PageGeometry
from vmemkv.scheduler.layout import PoolBacking
from vmemkv.scheduler.managers import UnmapExtent, make_manager
from vmemkv.scheduler.managers.window import WindowSwapError
from vmemkv.scheduler.presets import ModelSpec, get_model

from .shadow import dump

GEMMA3 = get_model("gemma-3-27b")   # 62 layers: 10 full (5, 11, ..., 59), 52 within 1,024 tokens
PAGE = 2 * MiB                      # one layer's K of 512 tokens (16 heads * 128 * 2 bytes)
TPP, GROUP, FULL, WINDOW = 512, 124, 20, 104     # tokens / pages per group, full, window kind


def gemma(pool_pages, max_len=32 * 1024, **kw):
    return make_manager("vmem", GEMMA3, pool_pages * PAGE, max_len, page_bytes=PAGE,
                        hybrid_parts=True, **kw)


def held_pages(tokens, window=1024):
    """Pages a sequence of ``tokens`` holds once its next query is at ``tokens``: FULL for
    every page U = ceil(n / tpp), WINDOW for all but the D = min((n - W + 1) // tpp, U - 1)
    pages wholly behind the window."""
    units = -(-tokens // TPP)
    dropped = min((tokens - window + 1) // TPP, units - 1)
    return units * FULL + (units - dropped) * WINDOW


def test_kind_page_counts_come_from_the_geometry():
    g = PageGeometry.of(GEMMA3, PAGE, "per-layer")
    assert (g.tokens_per_page, g.pages_per_group) == (TPP, GROUP)
    assert g.full_layers == tuple(range(5, 62, 6)) and len(g.window_layers) == 52
    m = gemma(GROUP)                         # members (one page each) per kind: full, window
    assert m.table.members == (FULL, WINDOW) and sum(m.table.members) == GROUP
    assert [k.layers for k in m.kinds] == [g.full_layers, g.window_layers]
    assert not PageGeometry.of(GEMMA3, PAGE, "interleaved").split
    assert not PageGeometry.of(get_model("mistral-7b-v0.1"), PAGE, "per-layer").split


@pytest.mark.parametrize("windows", [4, 16])
def test_one_sequence_at_4x_and_16x_the_window_holds_the_predicted_pages(windows):
    n = windows * 1024
    m = gemma(4 * GROUP * 32)
    m.allocate(0, n)
    assert m.bound_pages == -(-n // TPP) * GROUP          # the whole prompt at admission
    m.release_behind_window(0, n)
    assert m.bound_pages == held_pages(n) == {4: 368, 16: 848}[windows]
    stats = m.stats()                    # in tokens at full allocation, rounded to tokens
    assert abs(stats.allocated_bytes - held_pages(n) * PAGE) < stats.bytes_per_token
    assert m.kv_cache_usage() == held_pages(n) / m.pool_pages
    m.check_integrity()


def test_a_pool_admits_the_computed_larger_number_of_sequences():
    """Pool P = 4 sequences of 4,096 tokens at full allocation (4 * 992 pages); window-aware,
    each admission needs its whole prompt (992 pages) and then holds 368, so it admits
    k = (P - 992) // 368 + 1 = 9."""
    pool = 4 * 8 * GROUP
    plain = make_manager("vmem", GEMMA3, pool * PAGE, 32 * 1024, page_bytes=PAGE)
    hybrid = gemma(pool)
    counts = []
    for m in (plain, hybrid):
        k = 0
        while m.can_allocate(4096):
            m.allocate(k, 4096)
            m.release_behind_window(k, 4096)
            k += 1
        counts.append(k)
        m.check_integrity()
    assert counts == [4, (pool - 8 * GROUP) // held_pages(4096) + 1] == [4, 9]


def test_a_refused_allocation_names_the_pages_and_changes_nothing():
    m = gemma(8 * GROUP)
    m.allocate(0, 4096)
    before = dump(m)
    with pytest.raises(OutOfCapacityError, match=r"0 of 992 pages unbound \(a group takes 124\)"):
        m.allocate(1, 1024)
    assert dump(m) == before


def test_window_parts_go_back_only_when_no_fork_reads_them():
    m = gemma(4 * 8 * GROUP)
    m.allocate(0, 4096)
    m.fork(0, 1)
    m.take_ops()
    m.release_behind_window(0, 4096)
    ops = m.take_ops()
    window = m.kinds[1].name
    assert ops == [UnmapExtent(m.slot_of(0), pi, window)
                   for pi in range(6)]              # the fork still reads them: nothing released
    assert m.bound_pages == 8 * GROUP
    m.release_behind_window(1, 4096)
    assert m.take_ops() == [UnmapExtent(m.slot_of(1), pi, window) for pi in range(6)]  # pages:
    # back to the ledger, no op
    assert m.bound_pages == held_pages(4096)
    m.free(0)
    m.free(1)
    m.check_integrity()


def test_a_sequence_behind_its_window_is_recomputed_not_swapped():
    m = gemma(8 * GROUP * 4, swap_bytes=10**12)
    m.allocate(0, 4096)
    assert m.can_swap_out(0)
    m.release_behind_window(0, 4096)
    before = dump(m)
    assert not m.can_swap_out(0)
    with pytest.raises(WindowSwapError, match="6 page groups behind its 1024-token window"):
        m.swap_out(0)
    assert dump(m) == before


def test_a_prefix_whose_window_part_went_is_no_hit():
    m = gemma(8 * GROUP * 4)
    ids = list(range(4096))
    m.allocate(0, 4096, ids)
    m.mark_computed(0, 4096)
    assert m.can_allocate(4096, ids) and m.allocate(1, 4096, ids) == 4096 - TPP
    m.free(1)
    m.release_behind_window(0, 4096)
    assert m.allocate(2, 4096, ids) == 0      # page 0 is incomplete: nothing after it hits
    m.check_integrity()


def test_every_other_model_and_layout_keeps_one_kind_of_every_layer():
    mistral, plain = get_model("mistral-7b-v0.1"), get_model("llama-3-8b")
    for model, layout in [(mistral, "per-layer"), (plain, "per-layer"), (GEMMA3, "interleaved")]:
        m = make_manager("vmem", model, 10**10, 8192, layout=layout, hybrid_parts=True)
        assert len(m.kinds) == 1 and m.kinds[0].layers == tuple(range(model.num_layers))
        if m.geometry.exact:
            assert m.backing is PoolBacking.WHOLE
            assert m.pool_pages == m.num_groups * m.pages_per_group
        else:                    # gemma-3-27b interleaved: 31 pages a member, mapped by bytes
            assert m.backing is PoolBacking.BYTES and not m.geometry.split
    assert make_manager("vmem", GEMMA3, 10**10, 8192, layout="interleaved").window_tokens is None
    plain_gemma = make_manager("vmem", GEMMA3, 10**10, 8192)                    # opt-in
    assert [k.name for k in plain_gemma.kinds] == ["full"] and plain_gemma.window_tokens is None
    assert [k.name for k in gemma(GROUP).kinds] == ["full", "window-1024"]
    assert gemma(GROUP).pool_pages == GROUP
    with pytest.raises(ConfigError, match="hybrid_parts must be a bool, got 1"):
        make_manager("vmem", GEMMA3, 10**10, 8192, hybrid_parts=1)


def test_hybrid_model_spec_properties():
    assert GEMMA3.is_hybrid and GEMMA3.local_window_tokens == 1024 and GEMMA3.window_tokens is None
    assert not get_model("mistral-7b-v0.1").is_hybrid and not get_model("llama-3-8b").is_hybrid
    spec = ModelSpec("h", 2, 1, 1, 1, weight_bytes=0, layer_windows=(4, None))
    assert spec.is_hybrid and spec.local_window_tokens == 4


def test_journal_covers_every_hybrid_field():
    m = gemma(8 * GROUP * 4)
    m.allocate(0, 4096)
    m.release_behind_window(0, 4096)
    assert m.journal_gaps() == []


def test_rollback_restores_window_parts_exactly():
    m, twin = gemma(8 * GROUP * 4), gemma(8 * GROUP * 4)
    for x in (m, twin):
        x.allocate(0, 4096, list(range(4096)))
        x.mark_computed(0, 4096)
        x.take_ops()
    m.begin()
    m.fork(0, 1)
    m.release_behind_window(0, 4096)
    m.release_behind_window(1, 4096)
    m.free(0)
    m.allocate(2, 2048)
    m.rollback()
    assert dump(m) == dump(twin)
    m.check_integrity()


@pytest.mark.parametrize("layout, layers", [("interleaved", (0,)), ("per-layer", (1, 0)),
                                             ("per-layer", (0, 1, 2)), ("per-layer", (3,))])
def test_geometry_window_layers_are_checked(layout, layers):
    with pytest.raises(ConfigError, match=r"window_layers must be \(\) or increasing layer"):
        PageGeometry(layout, 4096, 3, 64, layers)


@pytest.mark.parametrize("tokens, whole_pages", [(1534, 3), (1535, 2)])
def test_a_page_the_next_query_still_reads_keeps_its_window_part(tokens, whole_pages):
    """At 1,534 tokens the next query reads from token 1534 - 1024 + 1 = 511, the last of
    page 0: every page stays whole; one token later page 0's window part goes."""
    m = gemma(4 * GROUP)
    m.allocate(0, tokens)
    m.release_behind_window(0, tokens)
    assert m.bound_pages == held_pages(tokens) == 3 * FULL + whole_pages * WINDOW
    m.check_integrity()


def test_growing_a_byte_mapped_group_reclaims_until_every_member_page_is_free():
    """3-byte tokens on 4-byte pages, one full layer and three windowed: a page of growth is
    2 full and 6 window pool pages. Four are unbound; the freed sequence's 24 are reclaimed
    for the window kind's 6, not taken from the 2 left after the full kind's."""
    model = ModelSpec("h3", 4, 3, 1, 1, weight_bytes=0, layer_windows=(None, 4, 4, 4))
    m = make_manager("vmem", model, 36 * 4, 16, page_bytes=4, max_slots=3, hybrid_parts=True)
    assert m.backing is PoolBacking.BYTES and m.table.members == (2, 6)
    m.allocate(0, 4)
    m.allocate(1, 1)
    m.free(0)                              # its 24 pages stay mapped, reclaimable
    assert (m.bound_pages, m.free_pages) == (32, 4)
    assert m.can_append(1, 1)
    m.append(1, 1)                         # 1 -> 2 tokens: 2 pages a member, 8 more pages
    assert (m.bound_pages, m.free_pages) == (16, 20)
    m.check_integrity()


def test_a_window_part_released_by_a_fork_unmaps_the_freed_parents_deferred_mappings():
    """The parent's whole mappings outlive it (deferred reclamation); once its fork, the last
    holder, leaves the window behind, the pages go back and no mapping may still show them."""
    m = gemma(4 * 8 * GROUP)
    m.allocate(0, 2048)
    m.fork(0, 1)
    parent, child = m.slot_of(0), m.slot_of(1)
    m.free(0)
    m.take_ops()
    m.release_behind_window(1, 2048)
    window = m.kinds[1].name
    assert m.take_ops() == [op for pi in range(2) for op in (
        UnmapExtent(child, pi, window), UnmapExtent(parent, pi, "full"),
        UnmapExtent(parent, pi, window))]
    assert m.bound_pages == held_pages(2048)
    m.check_integrity()


def test_a_cached_prefix_is_evicted_only_when_no_unbound_pages_are_left():
    """Three groups: a 2-page prompt cached, then a 1-page one takes the last unbound group
    (exactly a group's pages), not a cached one: the prompt still hits both its pages."""
    m = gemma(3 * GROUP)
    prompt = list(range(2 * TPP))
    m.allocate(0, 2 * TPP, prompt)
    m.mark_computed(0, 2 * TPP)
    m.free(0)
    m.allocate(1, TPP, [5] * TPP)
    assert m.free_pages == 0
    m.free(1)
    assert m.allocate(2, 2 * TPP + 1, prompt + [1]) == 2 * TPP
    m.check_integrity()
