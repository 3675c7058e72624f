"""``MemoryManager.unpublish``, the manager's part of a failed request (runtime/engine/ending.py):
nothing the sequence published or hit is found by a later prompt, whether it is resident (its
units, and what others still hold of them, lose their registrations) or swapped out (the
units its keys reach, cached or held by others); what only it held goes back to the pool, what
another holds stays held; inside a transaction a rollback undoes it all; the managers that
share nothing accept it as a no-op."""
import pytest

from vmemkv.scheduler.managers import POLICIES, make_manager
from vmemkv.scheduler.presets import ModelSpec

UNIT = 4
MODELS = {"one-kind": ModelSpec("llama", 6, 1, 1, 1, weight_bytes=0),
          "hybrid": ModelSpec("g3", 6, 1, 1, 1, weight_bytes=0,
                              layer_windows=(8,) * 5 + (None,))}
LAYOUTS = [("paged", "one-kind"), ("paged", "hybrid"), ("vmem", "one-kind"),
           ("vmem", "hybrid"), ("vmem-blocks", "one-kind")]
PROMPT = list(range(100, 114))        # 14 tokens: three whole 4-token units, then 2


def manager(policy, kind):
    model, unit_bytes = MODELS[kind], UNIT * 2 * 6       # a unit of every (1-byte) layer
    if policy == "paged":
        return make_manager("paged", model, 24 * unit_bytes, 48, block_size_tokens=UNIT,
                            swap_bytes=48 * 12)
    blocks = policy == "vmem-blocks"       # 8-token pages of two 4-token blocks
    page = 2 * UNIT if blocks else UNIT
    return make_manager("vmem", model, 24 * unit_bytes, 48, page_bytes=page, max_slots=4,
                        swap_bytes=48 * 12, hybrid_parts=kind == "hybrid",
                        prefix_block_tokens=UNIT if blocks else 0)


def hit(m, seq_id, ids=PROMPT):
    got = m.allocate(seq_id, len(ids), ids)
    m.mark_computed(seq_id, len(ids))
    return got


@pytest.mark.parametrize("policy, kind", LAYOUTS)
def test_a_resident_failed_sequence_is_found_no_more_and_its_sharer_keeps_its_units(policy,
                                                                                   kind):
    m = manager(policy, kind)
    assert hit(m, 0) == 0
    assert hit(m, 1) == 12                 # the second shares the first's three whole units
    held = m.sharing_units([1])
    m.unpublish(0)
    m.free(0)
    m.check_integrity()
    assert m.sharing_units([1]) == held    # what it shares stays held
    assert hit(m, 2) == 0                  # nothing of the failed one is found
    m.free(1)
    m.free(2)
    assert hit(m, 3) == 12                 # the one that computed it again published it
    m.check_integrity()


@pytest.mark.parametrize("policy, kind", LAYOUTS)
def test_a_failed_sequences_own_units_go_back_to_the_pool(policy, kind):
    m = manager(policy, kind)
    hit(m, 0)
    m.unpublish(0)
    m.free(0)
    assert m.cached_tokens == 0 and m.cached_units() == []
    assert m.kv_cache_usage() == 0.0
    m.check_idle()


@pytest.mark.parametrize("tokens", [len(PROMPT), 6])     # 6: vmem-blocks, inside page 0
@pytest.mark.parametrize("policy, kind", [("paged", "one-kind"), ("paged", "hybrid"),
                                          ("vmem", "one-kind"), ("vmem-blocks", "one-kind")])
def test_a_swapped_failed_sequence_is_found_no_more(policy, kind, tokens):
    m = manager(policy, kind)
    hit(m, 0, PROMPT[:tokens])
    m.swap_out(0)
    m.take_ops()
    assert m.cached_tokens > 0             # its units stay cached while it is swapped out
    m.unpublish(0)
    assert m.cached_tokens == 0 and m.cached_units() == []
    m.free(0)
    m.check_integrity()
    assert hit(m, 1, PROMPT[:tokens]) == 0


@pytest.mark.parametrize("policy, kind", LAYOUTS)
def test_a_rolled_back_unpublish_leaves_everything_findable(policy, kind):
    m = manager(policy, kind)
    hit(m, 0)
    m.begin()
    m.unpublish(0)
    m.free(0)
    m.rollback()
    m.free(0)
    assert hit(m, 1) == 12
    m.check_integrity()


@pytest.mark.parametrize("policy", [p for p in POLICIES if p.startswith("reserve")])
def test_managers_that_share_nothing_accept_unpublish(policy):
    m = make_manager(policy, MODELS["one-kind"], 24 * UNIT * 2 * 6, 48)
    m.allocate(0, len(PROMPT), PROMPT, final_tokens=len(PROMPT))
    m.unpublish(0)
    m.free(0)
    m.check_integrity()
