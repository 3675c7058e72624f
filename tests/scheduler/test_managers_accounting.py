"""Accounting and planned ops of each manager on small hand-checked examples."""
import cProfile
import pstats

import pytest

from vmemkv.scheduler.errors import ConfigError, OutOfCapacityError
from vmemkv.scheduler.managers import (POLICIES, CopyBlock, CopyExtent, MapExtent, PagedManager, SwapIn,
                                SwapOut, UnmapExtent, VmemManager, make_manager)


def map_fixed(slot, pi, g, ppg=2):
    """The MapExtent of fixed group ``g`` (its pages g * ppg ..., one kind "full")."""
    return MapExtent(slot, pi, "full", tuple(range(g * ppg, (g + 1) * ppg)))


def unmap_full(slot, pi, g=None):
    return UnmapExtent(slot, pi, "full")


def copy_full(src_slot, src_pi, dst_slot, dst_pi):
    return CopyExtent(src_slot, src_pi, dst_slot, dst_pi, "full")
from vmemkv.scheduler.presets import ModelSpec, get_model

from .test_managers_state_machine import fingerprint

LLAMA = get_model("llama-3-8b")
TINY = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)       # 1 byte per layer-token


def _three_sequences(policy, **kw):
    m = make_manager(policy, LLAMA, 60 * 10**9, 4096, **kw)
    for sid, n in enumerate([37, 1203, 450]):
        m.allocate(sid, n, final_tokens=n)
    m.check_integrity()
    return m.stats()


def test_hand_example_reservation_holds_max_length_for_each():
    s = _three_sequences("reserve-max")
    assert LLAMA.bytes_per_token == 128 * 1024
    assert (s.allocated_tokens, s.live_tokens) == (12288, 1690)
    assert round(100 * s.utilization, 1) == 13.8
    assert s.end_waste_tokens == 12288 - 1690


def test_hand_example_paged_16_holds_108_blocks_38_wasted():
    s = _three_sequences("paged", block_size_tokens=16)
    assert s.allocated_tokens == 108 * 16 == 1728
    assert s.end_waste_tokens == 38
    assert round(100 * s.utilization, 1) == 97.8
    assert s.allocated_bytes == 1728 * 128 * 1024


def test_hand_example_oracle_wastes_nothing():
    s = _three_sequences("reserve-oracle")
    assert s.allocated_tokens == s.live_tokens == 1690 and s.utilization == 1.0


def test_vmem_geometry_per_layer_and_interleaved():
    per = make_manager("vmem", LLAMA, 60 * 10**9, 4096)
    assert (per.tokens_per_page, per.pages_per_group, per.pages_per_slot) == (1024, 64, 4)
    assert per.num_groups == 60 * 10**9 // (64 * 2 * 2**20) and per.num_slots == per.num_groups
    inter = make_manager("vmem", LLAMA, 60 * 10**9, 4096, layout="interleaved", max_slots=256)
    assert (inter.tokens_per_page, inter.pages_per_group, inter.num_slots) == (32, 2, 256)


@pytest.mark.parametrize("kw, field", [
    (dict(policy="lru"), "policy"), (dict(cache_bytes=0), "cache_bytes"),
    (dict(max_seq_len_tokens=0), "max_seq_len_tokens"), (dict(block_size_tokens=0), "block_size_tokens"),
    (dict(page_bytes=-1), "page_bytes"), (dict(layout="rows"), "layout"),
    (dict(max_slots=0), "max_slots"), (dict(swap_bytes=-1), "swap_bytes"),
    (dict(policy="vmem", page_bytes=1024), "page_bytes"),
    (dict(policy="vmem", max_seq_len_tokens=4000), "max_seq_len_tokens"),
    (dict(policy="reserve-max", cache_bytes=2**20), "cache_bytes"),
    (dict(policy="paged", cache_bytes=2**20), "cache_bytes"),
])
def test_bad_config_names_field_and_value(kw, field):
    args = dict(policy="paged", cache_bytes=10**9, max_seq_len_tokens=4096)
    args.update(kw)
    policy = args.pop("policy")
    with pytest.raises(ConfigError, match=field):
        make_manager(policy, LLAMA, **args)


def test_vmem_bad_length_error_names_nearest_valid_lengths():
    with pytest.raises(ConfigError, match="nearest valid: 3072 or 4096"):
        make_manager("vmem", LLAMA, 10**10, 4000)


def _vmem(groups=4, pages=4, tpp=2, slots=None):
    return VmemManager(TINY, groups * 2 * tpp, pages * tpp, page_bytes=tpp, max_slots=slots)


def test_vmem_growth_maps_one_group_per_page():
    m = _vmem()
    m.allocate(0, 3)
    assert m.take_ops() == [map_fixed(0, 0, 0), map_fixed(0, 1, 1)]
    m.append(0)                       # fills page 1: no op
    assert m.take_ops() == []
    m.append(0)
    assert m.take_ops() == [map_fixed(0, 2, 2)]
    assert m.mapped_pages(0) == {0: 0, 1: 1, 2: 2}


def test_vmem_deferred_reclamation_free_unmaps_nothing_and_next_sequence_reuses_pages():
    m = _vmem(slots=3)
    m.allocate(0, 2)
    m.allocate(1, 6)
    m.take_ops()
    m.free(1)
    assert m.take_ops() == [] and m.stats().allocated_tokens == 8   # cached pages still held
    assert m.reclaimable_tokens == 6 and m.can_allocate(6) and not m.can_allocate(7)
    m.allocate(2, 5)                  # lands on slot 1, the free slot with the most pages
    assert m.slot_of(2) == 1 and m.take_ops() == []
    m.check_integrity()


def test_vmem_reclaims_on_demand_only_groups_no_live_sequence_uses():
    m = _vmem(groups=4, slots=3)
    m.allocate(0, 2)                  # slot 0, group 0
    m.allocate(1, 6)                  # slot 1, groups 1..3
    m.free(1)
    m.take_ops()
    assert m.can_allocate(6)          # reclaimable groups count as available
    m.allocate(2, 2)                  # slot 1 (3 mapped pages): reuses page 0, no op
    m.allocate(3, 4)                  # slot 2: needs 2 groups, both reclaimed from slot 1
    ops = m.take_ops()
    assert [type(o) for o in ops] == [UnmapExtent, MapExtent, UnmapExtent, MapExtent]
    assert all(o.slot == 1 and o.page_index >= 1 for o in ops if isinstance(o, UnmapExtent))
    assert not m.can_append(0, 1)     # all 4 groups are used now
    m.check_integrity()


def test_vmem_fork_shares_groups_and_writer_copies_partial_page():
    m = _vmem(groups=6, slots=2)
    m.allocate(0, 3)
    m.take_ops()
    m.fork(0, 1)
    assert m.take_ops() == [map_fixed(1, 0, 0), map_fixed(1, 1, 1)]
    m.append(1)                       # the child writes into the shared partial page 1
    assert m.take_ops() == [unmap_full(1, 1, 1), map_fixed(1, 1, 2), copy_full(0, 1, 1, 1)]
    m.append(0)                       # the parent's page 1 is private again: no op
    assert m.take_ops() == [] and m._refs[0] == 2 and m._refs[1] == 1


@pytest.mark.parametrize("policy", ["vmem", "paged"])
def test_a_write_into_a_shared_partial_unit_needs_room_for_its_copy(policy):
    """Copy-on-write takes a unit: with none free, ``can_append`` says no and ``append`` is
    refused, changing nothing; once a unit is free the write copies into it."""
    m = _vmem(groups=4, slots=3) if policy == "vmem" else \
        PagedManager(TINY, 4 * 2 * 2, 8, block_size_tokens=2)     # 4 units of 2 tokens each
    m.allocate(0, 3)                  # 2 units, the second partial (1 of 2 tokens)
    m.fork(0, 1)                      # both shared
    m.allocate(2, 4)                  # the other 2 units: none free
    assert not m.can_append(1, 1) and not m.can_append(0, 1)
    before = fingerprint(m)
    with pytest.raises(OutOfCapacityError):
        m.append(1, 1)
    assert fingerprint(m) == before
    m.free(2)
    assert m.can_append(1, 1)
    m.append(1, 1)
    m.check_integrity()


def test_vmem_prefix_hit_maps_the_cached_group_under_the_new_slot():
    m = _vmem(groups=8, slots=3)
    prompt = [5, 6, 7, 8, 9]
    m.allocate(0, 5, token_ids=prompt)          # pages 0,1 full and hashed
    assert m.allocate(1, 5, token_ids=prompt) == 0     # not computed yet: nothing published
    m.mark_computed(0, 5)                       # publish on compute
    m.allocate(2, 4, token_ids=[1, 2, 3, 4])    # slot 2, other content (published at free)
    m.free(1)
    m.free(2)
    m.take_ops()
    assert m.allocate(3, 5, token_ids=prompt) == 4     # slot 1 (most pages), shares two pages
    ops = m.take_ops()
    assert ops[:4] == [unmap_full(1, 0, 3), map_fixed(1, 0, 0), unmap_full(1, 1, 4), map_fixed(1, 1, 1)]
    assert (m.prefix_queries, m.prefix_hits) == (19, 4)
    assert m.allocate(4, 5, token_ids=prompt, namespace="lora-1") == 0   # other weights
    m.check_integrity()


def test_paged_fork_copy_on_write_gives_writer_a_new_block():
    m = PagedManager(TINY, 2 * 4 * 8, 32, block_size_tokens=4)
    m.allocate(0, 6)
    m.fork(0, 1)
    assert m.block_table(1) == m.block_table(0) == [0, 1]
    m.append(0)
    assert m.take_ops() == [CopyBlock(1, 2)]
    assert m.block_table(0) == [0, 2] and m.block_table(1) == [0, 1]
    m.check_integrity()


def test_paged_prefix_cache_survives_free_and_is_evicted_last():
    m = PagedManager(TINY, 2 * 4 * 4, 16, block_size_tokens=4)
    prompt = list(range(9))
    m.allocate(0, 9, token_ids=prompt)
    m.free(0)
    s = m.stats()
    assert s.free_tokens == 16 and s.allocated_tokens == 0   # cached blocks count as free
    assert m.allocate(1, 9, token_ids=prompt) == 8
    assert m.block_table(1)[:2] == [0, 1]
    m.free(1)
    m.allocate(2, 16)                 # needs every block: evicts the cached ones
    assert m.allocate(3, 0, token_ids=[]) == 0
    m.check_integrity()


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_out_then_in_emits_swap_ops_around_release_and_reallocation(policy):
    m = make_manager(policy, TINY, 2 * 64, 16, block_size_tokens=4, page_bytes=4,
                     swap_bytes=2 * 8)
    m.allocate(0, 5, final_tokens=8)
    m.take_ops()
    assert m.can_swap_out(0) and m.swap_out(0) == 5
    out = m.take_ops()[0]
    assert (type(out), out.seq_id, out.num_tokens) == (SwapOut, 0, 5)
    assert m.stats().live_tokens == 0
    assert m.num_tokens(0) == 5 and m.can_swap_in(0)
    m.swap_in(0)
    back = m.take_ops()[-1]
    assert (type(back), back.seq_id, back.num_tokens) == (SwapIn, 0, 5)
    assert m.stats().live_tokens == 5
    # the ops say where the tokens are: the runtime executes them after the manager moved on
    if policy == "paged":
        assert len(out.blocks) == 2 and len(back.blocks) == 2   # 5 tokens in blocks of 4
    if policy == "vmem":
        assert out.slot is not None and back.slot == m.slot_of(0)
    m.check_integrity()


def test_vmem_swapping_in_a_group_needs_a_free_slot_for_each_and_can_swap_in_all_agrees():
    m = make_manager("vmem", TINY, 2 * 64, 16, page_bytes=4, max_slots=2, swap_bytes=2 * 32)
    m.allocate(0, 3)
    m.allocate(1, 3)
    m.swap_out(0)
    m.swap_out(1)
    m.allocate(2, 3)                  # one of the 2 slots taken: memory for both, a slot for one
    assert m.can_swap_in_all([0]) and not m.can_swap_in_all([0, 1])
    m.begin()
    m.swap_in(0)
    with pytest.raises(OutOfCapacityError):
        m.swap_in(1)                  # what can_swap_in_all foresaw
    m.rollback()
    m.free(2)
    assert m.can_swap_in_all([0, 1])
    m.swap_in(0)
    m.swap_in(1)
    assert {m.slot_of(0), m.slot_of(1)} == {0, 1}
    m.check_integrity()


def _calls_per_append(policy: str, num_seqs: int, steps: int = 100) -> float:
    """Python function calls (cProfile's count, builtins included) per can_append + append,
    with ``num_seqs`` sequences each growing by ``steps`` tokens from 100."""
    m = make_manager(policy, LLAMA, 200 * 10**9, 4096, max_slots=400)
    for sid in range(num_seqs):
        m.allocate(sid, 100, final_tokens=4096)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        for sid in range(num_seqs):
            if m.can_append(sid):
                m.append(sid)
    profile.disable()
    m.check_integrity()
    return pstats.Stats(profile).total_calls / (steps * num_seqs)


@pytest.mark.parametrize("policy", POLICIES)
def test_append_hot_path_costs_a_few_calls_whatever_the_batch(policy):
    """The simulator asks can_append/append of every running sequence every step: each pair
    must cost a small, fixed number of calls, not a scan of the batch. Counted, not timed
    (a time per call fails on a busy machine; the timing lives in benchmarks/simulate.py)."""
    small, large = _calls_per_append(policy, 20), _calls_per_append(policy, 300)
    assert large <= 30, f"{policy}: {large:.1f} calls per can_append + append"
    assert large <= 1.05 * small, f"{policy}: {small:.1f} calls per pair at 20 sequences, {large:.1f} at 300"


@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_prefill_preempted_part_way_never_shares_its_uncomputed_units(policy):
    """A prompt whose prefill was cut short by preemption must not serve prefix hits for
    the units it never computed, while the units it did compute stay shareable."""
    m = make_manager(policy, TINY, 2 * 64, 16, block_size_tokens=4, page_bytes=4)
    unit = 4 if policy == "paged" else m.tokens_per_page
    prompt = list(range(3 * unit + 1))
    m.allocate(0, len(prompt), token_ids=prompt)
    m.free(0, computed_tokens=unit)               # only the first unit was computed
    hit = m.allocate(1, len(prompt), token_ids=prompt)
    assert hit == unit
    m.free(1)                                     # fully computed: everything stays findable
    assert m.allocate(2, len(prompt), token_ids=prompt) == 3 * unit
    m.check_integrity()


def test_paged_reviving_cached_blocks_costs_room_so_can_allocate_agrees_with_allocate():
    """A hit on a cached block takes it out of the cache: 4 revived hits and 1 new block need
    5 blocks of the 4 cached + 0 free. Refused, changing nothing; with 4 more free it fits."""
    m = PagedManager(TINY, 8 * 4 * 2, 32, block_size_tokens=4)      # 8 blocks of 4 tokens
    prompt = list(range(16))
    m.allocate(0, 16, prompt)
    m.mark_computed(0, 16)
    m.free(0)                         # its 4 blocks cached
    m.allocate(1, 16, [99] * 16)      # the other 4: none free
    assert not m.can_allocate(17, prompt + [7])
    before = fingerprint(m)
    with pytest.raises(OutOfCapacityError, match="needs 5 blocks"):
        m.allocate(2, 17, prompt + [7])
    assert fingerprint(m) == before
    m.free(1)
    assert m.can_allocate(17, prompt + [7]) and m.allocate(2, 17, prompt + [7]) == 16
    m.check_integrity()
