"""Prefix sharing cannot be forged or confused: a hit needs equal token ids along the whole
chain, whatever the digest function says, and is keyed on the prompt's content, never on the
identity of the list that carries it. Both unit layouts: paged blocks and vmem page groups."""
import hashlib

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.managers import PagedManager, VmemManager, prefix
from vmemkv.scheduler.presets import ModelSpec

ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token, 1 per layer-token
UNIT = 4                                                  # tokens per block / page


def manager(kind):
    if kind == "paged":
        return PagedManager(ONE_LAYER, 2 * UNIT * 32, 64, block_size_tokens=UNIT)
    return VmemManager(ONE_LAYER, 2 * UNIT * 32, 16 * UNIT, page_bytes=UNIT, max_slots=8)


def units_of(m, seq_id):
    if isinstance(m, PagedManager):
        return m.block_table(seq_id)
    pages = m.mapped_pages(m.slot_of(seq_id))
    return [pages[pi] for pi in sorted(pages)][:-(-m.num_tokens(seq_id) // UNIT)]


def shared_units(m, a, b):
    return set(units_of(m, a)) & set(units_of(m, b))


def admit(m, seq_id, ids, namespace=None):
    """Allocate and compute the prompt (publish on compute: only then can later ones hit it)."""
    assert m.can_allocate(len(ids), ids, namespace)
    hit = m.allocate(seq_id, len(ids), ids, namespace)
    m.mark_computed(seq_id, len(ids))
    return hit


COLLIDING = {
    "every digest equal": lambda parent, tokens: b"\0" * 32,
    "digest of the position only": lambda parent, tokens: hashlib.sha256(parent).digest(),
}


@pytest.mark.parametrize("kind", ["paged", "vmem"])
@pytest.mark.parametrize("collide", sorted(COLLIDING))
def test_prompts_whose_digests_collide_never_share_memory(kind, collide, monkeypatch):
    monkeypatch.setattr(prefix, "unit_digest", COLLIDING[collide])
    m = manager(kind)
    admit(m, 0, [1] * UNIT * 3 + [5])
    assert admit(m, 1, [2] * UNIT * 3 + [5]) == 0          # same digests, other tokens: a miss
    assert not shared_units(m, 0, 1)
    m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_equal_unit_after_a_different_prefix_is_not_a_hit_even_when_digests_collide(kind,
                                                                                   monkeypatch):
    """Unit 1 of C has the same tokens as unit 1 of B, but it was computed after another unit
    0: with digests that depend on the position only, only the registration chain tells."""
    monkeypatch.setattr(prefix, "unit_digest", COLLIDING["digest of the position only"])
    m = manager(kind)
    admit(m, 0, [1] * UNIT + [5])                           # A: registers unit 0 = [1]*U
    admit(m, 1, [9] * UNIT + [2] * UNIT + [5])              # C: unit 0 is a miss, unit 1 = [2]*U
    hit = admit(m, 2, [1] * UNIT + [2] * UNIT + [5])        # B: unit 0 is A's, unit 1 is not C's
    assert hit == UNIT
    assert shared_units(m, 2, 0) == set(units_of(m, 0)[:1]) and not shared_units(m, 2, 1)
    m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_token_list_changed_between_can_allocate_and_allocate_is_keyed_on_its_new_content(kind):
    m = manager(kind)
    admit(m, 0, [1] * UNIT * 3 + [5])
    ids = [1] * UNIT * 3 + [5]
    assert m.can_allocate(len(ids), ids)                    # hashes (and memoises) [1, 1, ...]
    ids[:] = [7] * UNIT * 3 + [5]                           # same list object, other prompt
    assert m.allocate(1, len(ids), ids) == 0
    assert not shared_units(m, 0, 1)
    m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_equal_prompts_share_every_full_unit_but_the_last_token_and_namespaces_never(kind):
    m = manager(kind)
    ids = list(range(UNIT * 3)) + [5]
    admit(m, 0, ids)
    assert admit(m, 1, list(ids)) == UNIT * 3
    assert len(shared_units(m, 0, 1)) == 3
    assert admit(m, 2, list(ids), namespace="adapter-a") == 0
    assert admit(m, 3, list(ids), namespace="") == 0       # "" is not None
    assert m.prefix_hits == UNIT * 3
    m.check_integrity()


def test_unit_digests_are_sha256_chained_on_the_parent_and_seeded_by_the_namespace():
    data = prefix.token_bytes([1, 2, 3, 4, 5, 6, 7, 8])
    keys = prefix.unit_keys(data, UNIT, prefix.namespace_root(None))
    root = prefix.namespace_root(None)
    assert keys[0].digest == hashlib.sha256(root + data[:UNIT * 8]).digest()
    assert keys[1].digest == hashlib.sha256(keys[0].digest + data[UNIT * 8:]).digest()
    assert keys[1].tokens == data[UNIT * 8:]
    other = prefix.unit_keys(data, UNIT, prefix.namespace_root("a"))
    assert {k.digest for k in keys}.isdisjoint(k.digest for k in other)


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_token_id_outside_int64_is_a_config_error_that_changes_nothing(kind):
    m = manager(kind)
    before = m.stats()
    with pytest.raises(ConfigError, match=f"token id {2**70} is not an int in"):
        m.allocate(0, 6, [1, 2**70, 3, 4, 5, 6])
    with pytest.raises(ConfigError, match=r"token id .* is not an int in \[-2\*\*63"):
        m.allocate(0, 8, [1, 2, 3, 4, 5, 6, 7, -2**64])       # past the shareable units, too
    assert m.stats() == before and m.prefix_queries == 0
    m.allocate(0, 3, [1, 2, 3])
    with pytest.raises(ConfigError, match=r"token id .* is not an int in \[-2\*\*63"):
        m.append(0, 1, [2**63])
    assert m.num_tokens(0) == 3
    m.check_integrity()


def test_unit_whose_parent_was_overwritten_is_not_a_hit_even_when_digests_collide(monkeypatch):
    """C's unit 0 is dropped (overwritten) while its unit 1 stays registered. A later, different
    unit 0 then takes the same (position-only) digest: unit 1 must not be found behind it,
    because it was computed after the overwritten content."""
    monkeypatch.setattr(prefix, "unit_digest", COLLIDING["digest of the position only"])
    keys = lambda ids: prefix.unit_keys(prefix.token_bytes(ids), UNIT, prefix.namespace_root(None))
    index = prefix.PrefixIndex()
    c0, c1 = keys([9] * UNIT + [2] * UNIT)
    index.register(0, c0, None)
    index.register(1, c1, 0)                  # C: units 0 and 1
    index.drop(0)                             # unit 0 is overwritten; unit 1 stays
    a0, b1 = keys([1] * UNIT + [2] * UNIT)
    assert b1 == c1                           # equal digest and tokens: only the chain differs
    index.register(2, a0, None)               # A: a new unit 0 takes the digest
    assert index.match([a0, b1]) == [2]       # B finds A's unit 0, not C's unit 1 behind it
    index.check()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_namespace_that_is_not_a_str_is_a_config_error_that_changes_nothing(kind):
    m = manager(kind)
    with pytest.raises(ConfigError, match="namespace must be a str or None, got 7"):
        m.allocate(0, 6, [1, 2, 3, 4, 5, 6], namespace=7)
    assert m.stats().live_tokens == 0 and m.prefix_queries == 0
