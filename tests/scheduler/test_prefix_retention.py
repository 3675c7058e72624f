"""Prefix caching across requests in the managers: publish on compute, retention after free,
eviction by policy, cache salts, and the vLLM-named accounting. Both layouts."""
import pytest

from vmemkv.scheduler.errors import ConfigError, OutOfCapacityError
from vmemkv.scheduler.managers import (EVICTION_POLICIES, CopyExtent, MapExtent, PagedManager,
                                       VmemManager, make_manager)
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request

from .test_managers_state_machine import fingerprint

ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token
UNIT = 4                                                  # tokens per block / page
P = [1, 2, 3, 4, 5, 6, 7, 8]                              # two full units


def manager(kind, units=16, eviction="lru"):
    if kind == "paged":
        return PagedManager(ONE_LAYER, 2 * UNIT * units, 16 * UNIT, block_size_tokens=UNIT,
                            prefix_eviction=eviction)
    return VmemManager(ONE_LAYER, 2 * UNIT * units, 16 * UNIT, page_bytes=UNIT, max_slots=8,
                       prefix_eviction=eviction)


def run(m, seq_id, ids, namespace=None, computed=True):
    """Allocate ``ids`` and (by default) compute them; returns the hit tokens."""
    hit = m.allocate(seq_id, len(ids), ids, namespace)
    if computed:
        m.mark_computed(seq_id, len(ids))
    m.check_integrity()
    return hit


KINDS = pytest.mark.parametrize("kind", ["paged", "vmem"])


@KINDS
def test_units_serve_hits_only_once_computed(kind):
    m = manager(kind)
    run(m, 0, P + [9], computed=False)
    assert run(m, 1, P + [9], computed=False) == 0        # nothing computed: nothing published
    m.mark_computed(0, 5)                                  # unit 0 computed, unit 1 not
    assert run(m, 2, P + [9]) == UNIT
    m.mark_computed(0, 9)
    assert run(m, 3, P + [9]) == 2 * UNIT


@KINDS
def test_free_publishes_only_the_tokens_it_is_told_were_computed(kind):
    m = manager(kind)
    run(m, 0, P + [9], computed=False)
    m.free(0, computed_tokens=UNIT + 1)                    # preempted part-way through unit 1
    assert run(m, 1, P + [9]) == UNIT


@KINDS
def test_a_finished_requests_prefix_is_hit_after_it_ends_unless_retention_is_off(kind):
    for eviction, expected in (("lru", 2 * UNIT), ("hits", 2 * UNIT), ("off", 0)):
        m = manager(kind, eviction=eviction)
        run(m, 0, P + [9])
        m.free(0)
        assert m.cached_tokens == (0 if eviction == "off" else 2 * UNIT)
        assert run(m, 1, P + [10]) == expected, eviction
        assert m.cached_tokens == 0


@KINDS
def test_cached_units_count_as_free_in_kv_cache_usage_and_are_evicted_when_needed(kind):
    m = manager(kind, units=4)
    run(m, 0, P + [9])                                     # 3 units
    assert m.kv_cache_usage() == pytest.approx(3 / 4)
    m.free(0)
    assert m.kv_cache_usage() == 0.0 and m.cached_tokens == 2 * UNIT
    assert m.can_allocate(4 * UNIT)                        # cached units are available
    run(m, 1, [7] * (4 * UNIT))                            # evicts both
    assert m.cached_tokens == 0 and m.kv_cache_usage() == 1.0
    m.free(1)
    assert run(m, 2, P + [9]) == 0                         # P's content is gone


@KINDS
def test_lru_evicts_a_finished_requests_last_unit_first(kind):
    m = manager(kind, units=4)
    run(m, 0, P + [1, 2, 3, 4, 9])                         # 4 blocks, 3 full
    m.free(0)                                              # partial unit 3 is not cached
    run(m, 1, [7, 7])                                      # the free block: nothing evicted
    run(m, 2, [8, 8])                                      # evicts the deepest cached unit
    assert m.cached_tokens == 2 * UNIT
    m.free(1)
    m.free(2)
    assert run(m, 3, P + [1, 2, 3, 4, 9]) == 2 * UNIT      # P is still whole


@KINDS
def test_a_hit_on_cached_units_takes_their_room_and_can_allocate_agrees(kind):
    """Cached units a hit revives were counted as available: reviving them uses that room.
    P + [1, 2, 3, 4, 9] is 4 units of which 3 are cached; with the fourth unit held by another
    request only those 3 are available, so the same prompt (3 hit + 1 new) does not fit."""
    m = manager(kind, units=4)
    prompt = P + [1, 2, 3, 4, 9]
    run(m, 0, prompt)
    m.free(0)
    run(m, 1, [7, 7])                                      # the one unit not cached
    assert not m.can_allocate(len(prompt), prompt)
    before = fingerprint(m)
    with pytest.raises(OutOfCapacityError):
        m.allocate(2, len(prompt), prompt)
    assert fingerprint(m) == before
    m.free(1)
    assert m.can_allocate(len(prompt), prompt)
    assert run(m, 2, prompt) == 3 * UNIT


@KINDS
def test_hits_policy_keeps_an_often_shared_prefix_that_lru_evicts(kind):
    """P is hit twice, then a cold prompt Q is released after it; two cached units must go.
    lru evicts P's (released earlier), hits evicts Q's (never hit)."""
    kept = {}
    for eviction in ("lru", "hits"):
        m = manager(kind, units=6, eviction=eviction)
        for seq_id in range(3):                           # P + a private partial unit each
            assert run(m, seq_id, P + [9]) == (2 * UNIT if seq_id else 0)
            m.free(seq_id)
        run(m, 3, [5] * (2 * UNIT) + [9])                  # Q, released last
        m.free(3)
        run(m, 4, [6] * (4 * UNIT))                        # 2 free units + 2 evicted
        m.free(4)
        q_hit = run(m, 5, [5] * (2 * UNIT) + [9])
        kept[eviction] = (run(m, 6, P + [9]), q_hit)
    assert kept == {"lru": (0, 2 * UNIT), "hits": (2 * UNIT, 0)}


@KINDS
def test_reset_prefix_cache_brings_memory_back_to_its_baseline(kind):
    m = manager(kind)
    for seq_id in range(3):
        run(m, seq_id, P + [seq_id] * UNIT + [9])
    for seq_id in range(3):
        m.free(seq_id)
    assert m.cached_tokens > 0
    assert m.reset_prefix_cache() == 2 + 3                 # P, and each third unit
    st = m.stats()
    assert m.cached_tokens == 0 and m.kv_cache_usage() == 0.0 and st.live_tokens == 0
    unmapped = getattr(m, "reclaimable_tokens", 0)         # vmem: groups still mapped, no content
    assert st.free_tokens + unmapped == st.total_tokens
    assert run(m, 9, P + [9]) == 0
    m.check_integrity()


def test_vmem_hit_maps_the_cached_group_itself_and_copies_nothing():
    m = manager("vmem")
    run(m, 0, P + [9])
    groups = m.mapped_pages(m.slot_of(0))
    run(m, 1, [3, 3])                                      # another slot, other content
    m.free(0)                                              # slot 0 free, its groups cached
    m.take_ops()
    run(m, 2, P + [10])                                    # placed on slot 0: nothing to map
    ops = m.take_ops()
    assert m.slot_of(2) == 0
    assert not [op for op in ops if isinstance(op, MapExtent) and op.page_index < 2]
    run(m, 3, P + [11])                                    # slot 0 busy: map the same groups
    ops = m.take_ops()
    slot = m.slot_of(3)
    extents = m.mapped_extents(slot)      # the same pool pages as slot 0 had, mapped again
    assert all(MapExtent(slot, pi, kind, pages) in ops
               for pi in (0, 1) for kind, pages in extents[pi].items())
    assert m.mapped_pages(slot)[0] == groups[0] and m.mapped_pages(slot)[1] == groups[1]
    assert not [op for op in ops if isinstance(op, CopyExtent)]


@KINDS
def test_equal_prompts_with_different_cache_salts_never_share(kind):
    m = manager(kind)
    salted = [Request(i, 9, 1, prompt_token_ids=P + [9], cache_salt=salt)
              for i, salt in enumerate(["alice", "bob", "alice", None])]
    hits = []
    for r in salted:
        hits.append(run(m, r.request_id, list(r.prompt_token_ids), r.prefix_scope))
        m.free(r.request_id)
    assert hits == [0, 0, 2 * UNIT, 0]


def test_cache_salt_and_namespace_are_checked():
    with pytest.raises(ConfigError, match="cache_salt"):
        Request(0, 1, 1, cache_salt=5)
    with pytest.raises(ConfigError, match="namespace may not start"):
        Request(0, 1, 1, namespace="\x1fsalt")
    assert Request(0, 1, 1, namespace="a").prefix_scope == "a"
    assert Request(0, 1, 1, namespace="a", cache_salt="s").prefix_scope != "a"


@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_unknown_eviction_policy_is_a_config_error_naming_the_choices(policy):
    with pytest.raises(ConfigError, match="prefix_eviction must be one of off, lru, hits"):
        make_manager(policy, ONE_LAYER, 2 * UNIT * 8, 8 * UNIT, block_size_tokens=UNIT,
                     page_bytes=UNIT, prefix_eviction="fifo")
    assert set(EVICTION_POLICIES) == {"off", "lru", "hits"}


@KINDS
def test_a_sequence_computed_beside_an_equal_one_still_publishes_the_units_after_it(kind):
    """A and B share P and compute it in the same step: A's copy is published first, B's is a
    duplicate. B's own third unit must still be findable, chained behind A's copy of P."""
    m = manager(kind)
    run(m, 0, P + [9], computed=False)
    run(m, 1, P + [1, 1, 1, 1] + [9], computed=False)
    m.mark_computed(0, 9)
    m.mark_computed(1, 13)
    assert run(m, 2, P + [1, 1, 1, 1] + [5]) == 3 * UNIT
