"""The undo journal against whole-state copies: random manager calls inside begin/rollback
leave every manager (paged, vmem per-layer and interleaved, a windowed vmem, the hybrid vmem
of a Gemma-3 pattern) exactly as a deep copy taken at begin, now and for every later call;
inside begin/commit they leave it exactly as the same calls run without a transaction."""
import copy
import functools
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from vmemkv.scheduler.errors import SchedulerError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import ModelSpec

from ..hypothesis_budget import examples
from .shadow import dump, full_only_pages, group_extents

TWO = ModelSpec("t2", 2, 1, 1, 1, weight_bytes=0)                        # 4 bytes a token
WINDOWED = ModelSpec("w2", 2, 1, 1, 1, weight_bytes=0, layer_windows=(6, 6))
GEMMA3_LIKE = ModelSpec("g3", 6, 1, 1, 1, weight_bytes=0,                  # 5 local : 1 global
                        layer_windows=(6, 6, 6, 6, 6, None))
SEQS = range(6)
PREFIXES = ([1] * 8, [1] * 4 + [2] * 4, [3] * 8)
CONFIGS = {
    "paged": (TWO, dict(block_size_tokens=4)),
    "paged-hits": (TWO, dict(block_size_tokens=4, prefix_eviction="hits")),
    "vmem-per-layer": (TWO, dict(page_bytes=4, max_slots=5)),
    "vmem-interleaved": (TWO, dict(page_bytes=16, layout="interleaved", max_slots=5)),
    "vmem-windowed": (WINDOWED, dict(page_bytes=4, max_slots=5)),
    "hybrid": (GEMMA3_LIKE, dict(page_bytes=4, max_slots=5, hybrid_parts=True)),
    "paged-hybrid": (GEMMA3_LIKE, dict(block_size_tokens=4)),
}


def build(name):
    model, kw = CONFIGS[name]
    policy = "paged" if name.startswith("paged") else "vmem"
    return make_manager(policy, model, 22 * 16 * model.num_layers // 2, 32,
                        swap_bytes=40 * model.bytes_per_token, **kw)


def prompts():
    tail = st.lists(st.integers(0, 3), max_size=7)
    return st.builds(lambda p, k, t: p[:k] + t, st.sampled_from(PREFIXES), st.integers(0, 8), tail)


NAMES = ["allocate"] * 3 + ["append"] * 3 + ["mark_computed"] * 2 + [
    "fork", "free", "swap_out", "swap_in", "release_behind_window", "reset_prefix_cache",
    "take_ops"]
# strategies built once: a new strategy object is validated on its first draw, which took a
# quarter of these tests' time when every call built its own
NAME, PROMPT, BOOL = st.sampled_from(NAMES), prompts(), st.booleans()
APPEND_TOKENS, FREE_COMPUTED = st.integers(1, 6), st.one_of(st.none(), st.integers(0, 12))


@functools.lru_cache(maxsize=None)
def one_of_ids(ids: tuple):
    return st.sampled_from(ids)


@functools.lru_cache(maxsize=None)
def up_to(n: int):
    return st.integers(0, n)


def draw_call(data, m):
    """One call, aimed mostly at sequences ``m`` holds (new ids for allocate and fork)."""
    name = data.draw(NAME)
    held = [s for s in SEQS if isinstance(apply(m, ("num_tokens", s)), int)]
    new = one_of_ids(tuple(s for s in SEQS if s not in held) or tuple(SEQS))
    aim = [s for s in held if m.is_swapped(s) == (name == "swap_in")]
    sid = data.draw(one_of_ids(tuple(aim or SEQS)))
    if name == "allocate":
        return (name, data.draw(new), data.draw(PROMPT), data.draw(BOOL))
    if name == "append":
        return (name, sid, data.draw(APPEND_TOKENS), data.draw(BOOL))
    if name == "fork":
        return (name, sid, data.draw(new))
    if name == "free":
        return (name, sid, data.draw(FREE_COMPUTED))
    return (name,) if name in ("reset_prefix_cache", "take_ops") else (name, sid)


def run_drawn(data, m, max_calls):
    """Draw and run up to ``max_calls`` calls on ``m``: [(call, result)]."""
    done = []
    for _ in range(data.draw(up_to(max_calls))):
        call = draw_call(data, m)
        done.append((call, apply(m, call)))
    return done


def apply(m, call):
    """Run one call; its result, or the type of the typed error it raised."""
    name, *args = call
    try:
        if name == "allocate":
            ids, known = args[1], args[2]
            return m.allocate(args[0], max(len(ids), 1), (ids or [0]) if known else None)
        if name == "append":
            ids = [9] * args[1] if args[2] else None
            return m.append(args[0], args[1], ids)
        if name in ("mark_computed", "release_behind_window"):
            return getattr(m, name)(args[0], m.num_tokens(args[0]))
        if name == "free":
            return m.free(args[0], computed_tokens=args[1])
        return getattr(m, name)(*args)
    except SchedulerError as err:
        return type(err).__name__


def observe(m):
    """Everything a caller can read: stats, tables, mappings, swap, prefix hits of probe
    prompts (each probed inside its own begin/rollback), the pending ops (drained)."""
    out = [m.stats(), m.prefix_hits, m.prefix_queries, m.cached_tokens, m.cached_units(),
           m.kv_cache_usage(), m.swap_free_bytes]
    for sid in SEQS:
        held = apply(m, ("num_tokens", sid))
        out.append((held, m.is_swapped(sid)))
        if isinstance(held, int) and not m.is_swapped(sid):
            out.append(m.block_table(sid) if hasattr(m, "block_table") else m.slot_of(sid))
    for slot in range(getattr(m, "num_slots", 0)):
        out.append((m.mapped_pages(slot), full_only_pages(m, slot)))
    if hasattr(m, "table"):
        out += [group_extents(m, g) for g in range(m.num_groups)] + [m.free_pages]
    if hasattr(m, "ledger"):
        out += [m.ledger.tenants(), m.ledger.free_pages] + [m.mapped_extents(s) for s in range(m.num_slots)]
    for probe in PREFIXES:
        m.begin()
        out.append(apply(m, ("allocate", 99, probe + [0], True)))
        m.rollback()
    out.append(m.take_ops())
    return out


# 60 examples each, through tests/hypothesis_budget.py as every other machine's count: half in
# the ci profile, all 60 under HYPOTHESIS_PROFILE=thorough
@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_rollback_restores_the_whole_state_taken_at_begin(name, data):
    m = build(name)
    run_drawn(data, m, 30)
    at_begin = copy.deepcopy(m)
    m.begin()
    run_drawn(data, m, 30)
    m.rollback()
    m.check_integrity()
    assert dump(m) == dump(at_begin)
    assert observe(m) == observe(at_begin)
    later = run_drawn(data, m, 12)              # and every later call does the same
    assert later == [(call, apply(at_begin, call)) for call, _ in later]
    assert dump(m) == dump(at_begin)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_commit_is_as_if_the_calls_ran_without_a_transaction(name, data):
    m, plain = build(name), build(name)
    for call, _ in run_drawn(data, m, 30):
        apply(plain, call)
    m.begin()
    inside = run_drawn(data, m, 30)
    m.commit()
    assert inside == [(call, apply(plain, call)) for call, _ in inside]
    m.check_integrity()
    assert dump(m) == dump(plain)
    assert observe(m) == observe(plain)


def journal_size(m):
    return m._cell.size()


@pytest.mark.parametrize("units", [100, 10_000])
@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_begin_saves_and_a_decode_append_logs_the_same_whatever_the_pool(policy, units):
    """O(1) begin, O(changes) journal: a pool 100 times larger, full of cached prefixes, saves
    exactly as much at begin and logs exactly as much for one append as a small one."""
    m = make_manager(policy, TWO, units * 16, 64, block_size_tokens=4, page_bytes=4, max_slots=4)
    for sid in range(units // 16):
        ids = [sid] * 64                        # distinct prompts of 16 units each
        m.allocate(sid, 64, ids)
        m.mark_computed(sid, 64)
        m.free(sid)
    m.allocate(0, 5)
    assert m.cached_tokens >= (units - 32) * 4
    m.begin()
    at_begin = journal_size(m)
    m.append(0)                                 # room in its private last unit
    assert (at_begin, journal_size(m)) == (len(m._SAVED_FIELDS) + 1, at_begin + 2)
    m.rollback()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_manager_pickles_and_its_copy_rolls_back_on_its_own(name):
    """The journaled containers survive pickle (as deepcopy) with their manager's cell."""
    m = build(name)
    m.allocate(0, 9, [1] * 9)
    m.mark_computed(0, 9)
    twin = pickle.loads(pickle.dumps(m))
    assert dump(twin) == dump(m)
    twin.begin()
    twin.append(0, 3, [2, 2, 2])
    twin.free(0)
    twin.rollback()
    twin.check_integrity()
    assert dump(twin) == dump(m) and not m.in_transaction
