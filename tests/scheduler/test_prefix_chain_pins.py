"""Prefix keys and the units they name, pinned where a slip would serve another prompt's K/V
or keep memory nobody can reach: keys only of full units, a chain registered only on a
registered parent, a rolled-back append's ids never published, a failed request's content
unfindable (and nobody else's made so), vmem block hits that never cover the last token or
take room the allocation needs. Both unit layouts."""

import pytest

from vmemkv.scheduler.managers import PagedManager, VmemManager, make_manager, prefix
from vmemkv.scheduler.presets import ModelSpec

ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token
UNIT = 4                                                  # tokens per block / page


def manager(kind, **kw):
    if kind == "paged":
        return PagedManager(ONE_LAYER, 2 * UNIT * 32, 64, block_size_tokens=UNIT, **kw)
    return VmemManager(ONE_LAYER, 2 * UNIT * 32, 16 * UNIT, page_bytes=UNIT, max_slots=8, **kw)


def keys_of(ids, namespace=None):
    return prefix.unit_keys(prefix.token_bytes(ids), UNIT, prefix.namespace_root(namespace))


def test_unit_keys_name_only_full_units():
    keys = keys_of(list(range(2 * UNIT + 2)))
    assert len(keys) == 2
    assert [k.tokens for k in keys] == [prefix.token_bytes(range(0, UNIT)),
                                        prefix.token_bytes(range(UNIT, 2 * UNIT))]
    assert keys_of([1] * (UNIT - 1)) == []


def test_a_unit_chained_on_an_unregistered_parent_is_not_registered():
    index = prefix.ChainedPrefixIndex()
    k0, k1 = keys_of([1] * 2 * UNIT)
    index.register(11, k1, parent_unit=10)          # 10 was never registered: unverifiable
    assert index.by_unit == {} and index.by_digest == {}
    index.register(10, k0, None)
    index.register(11, k1, 10)
    assert index.match([k0, k1]) == [10, 11]
    index.check()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_a_rolled_back_appends_ids_are_never_a_prefix_key(kind):
    m = manager(kind)
    m.allocate(0, 6, [1, 2, 3, 4, 5, 6])
    m.mark_computed(0, 6)
    m.begin()
    m.append(0, 2, [7, 8])              # fills unit 1 with [5, 6, 7, 8] ...
    m.rollback()                        # ... undone: the step sampled other tokens
    m.append(0, 2, [9, 9])
    m.mark_computed(0, 8)
    m.check_integrity()
    assert m.allocate(1, 9, [1, 2, 3, 4, 5, 6, 7, 8, 0]) == UNIT     # unit 0 only
    m.free(1)
    assert m.allocate(2, 9, [1, 2, 3, 4, 5, 6, 9, 9, 0]) == 2 * UNIT
    m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_a_duplicate_publishes_no_unit_whose_chain_was_evicted_part_way(kind):
    """Two requests compute one prompt at once: the second's units are duplicates, so it
    chains its unit k on the first's registrations. When some of those went (evicted), its
    unit k is not registered under a shorter chain (no prompt could reach it, and it would
    hold the digest against the next request that computes that content)."""
    m = manager(kind)
    prompt = list(range(3 * UNIT + 1))                # units 0, 1, 2 full
    m.allocate(0, len(prompt), prompt)
    m.allocate(1, len(prompt), prompt)                # no hit: nothing computed yet
    m.mark_computed(0, len(prompt))                   # request 0 registers units 0..2
    m.mark_computed(1, 2 * UNIT)                      # request 1's units 0, 1: duplicates
    m.free(0)                                         # cached, its tail first to go (lru)
    # 32 units: request 1 holds 4, 3 cached; 16 more held leave 9 free, and 11 wanted
    m.allocate(2, 16 * UNIT)
    m.allocate(3, 11 * UNIT)                          # evict request 0's units 2, then 1
    assert len(m.cached_units()) == 1                 # its unit 0 is left
    m.mark_computed(1, len(prompt))                   # its unit 2: chain cut at unit 0
    m.free(2)
    m.free(3)
    assert m.allocate(4, len(prompt), prompt) == UNIT          # request 0's unit 0 only
    m.mark_computed(4, len(prompt))                   # registers its units 1 and 2
    assert m.allocate(5, len(prompt), prompt) == 3 * UNIT
    m.check_integrity()


PROMPT = list(range(3 * UNIT + 1))                    # units 0, 1, 2 full


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_a_failed_sequence_publishes_nothing_more_not_even_at_free(kind):
    m = manager(kind)
    m.allocate(0, len(PROMPT), PROMPT)
    m.unpublish(0)                                    # failed before it published anything
    m.mark_computed(0, len(PROMPT))
    m.free(0)                                         # (computed_tokens None: all it held)
    assert m.allocate(1, len(PROMPT), PROMPT) == 0
    m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_a_swapped_sequence_that_computed_nothing_unpublishes_nothing_of_others(kind):
    m = manager(kind, swap_bytes=1 << 20)
    m.allocate(0, len(PROMPT), PROMPT)                # the failing one: computes nothing
    m.allocate(1, len(PROMPT), PROMPT)
    m.mark_computed(1, len(PROMPT))                   # another request's units, published
    m.swap_out(0)
    m.unpublish(0)
    assert m.allocate(2, len(PROMPT), PROMPT) == 3 * UNIT
    m.check_integrity()


@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_unpublished_tokens_of_a_forgotten_request_are_found_no_more(kind):
    m = manager(kind)
    m.allocate(0, len(PROMPT), PROMPT)
    m.mark_computed(0, len(PROMPT))
    m.free(0)                                         # cached; its record forgotten
    m.unpublish_tokens(PROMPT, None)
    assert m.cached_units() == []                     # nobody holds them: back to the pool
    assert m.allocate(1, len(PROMPT), PROMPT) == 0
    m.check_integrity()


# -- vmem block-granular hits (blocks.py): 1 KiB pages of 64 tokens, 16-token blocks --
BLOCK_MODEL = ModelSpec("t", 2, 1, 8, 2, 0)             # 64 bytes a token, 16 page groups
SYSTEM = list(range(1000, 1040))                         # 40 tokens: two whole blocks


def block_manager():
    return make_manager("vmem", BLOCK_MODEL, 64 * 1024, 512, page_bytes=1024,
                        prefix_block_tokens=16)


def cache_system_prompt(m):
    a = SYSTEM + [1, 2, 3]
    m.allocate(0, len(a), a)
    m.mark_computed(0, len(a))
    m.free(0)                                            # its page cached: blocks findable


def test_a_block_hit_never_covers_a_prompts_last_token():
    m = block_manager()
    cache_system_prompt(m)
    assert m.allocate(1, 32, SYSTEM[:32]) == 16          # block 1 holds the last token
    m.check_integrity()


def test_no_block_hit_when_holding_its_source_leaves_no_room_for_the_new_page():
    m = block_manager()
    cache_system_prompt(m)
    for seq_id in range(10, 25):                         # 15 of 16 groups: only the cached
        m.allocate(seq_id, 64)                           # source's pages are left
    b = SYSTEM[:32] + [9] * 20
    assert m.can_allocate(len(b), b)
    assert m.allocate(5, len(b), b) == 0                 # the source is evicted instead
    assert m.cached_units() == []
    m.check_integrity()
