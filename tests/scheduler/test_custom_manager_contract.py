"""A user's memory manager is held to the interface it implements: the prefix hit its
``allocate`` returns is an int from 0 to the tokens it could hit (none without token ids or
with ``lookup=False``), and what its ``stats()`` / ``kv_cache_usage()`` return keeps
MemoryStats' invariants. Anything else is refused with ManagerContractError (a PolicyError)
naming the class and the method, before a figure is computed from it; a refused allocation
is undone. The built-in managers never trip either check."""
import math
import sys

import pytest

from vmemkv.scheduler.errors import PolicyError, UnknownSequenceError
from vmemkv.scheduler.managers import PagedManager
from vmemkv.scheduler.managers.base import ManagerContractError, MemoryStats, check_hit
from vmemkv.scheduler.presets import ModelSpec
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig
from vmemkv.scheduler.sim_sums import step_figures
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry

# 2 layers, one KV head of 8 fp16 dims: 64 bytes a token; 4-token blocks
MODEL = ModelSpec("t", 2, 1, 8, 2, 0)
PROMPT_TOKENS = 20


class Claims(PagedManager):
    """Paged, but ``allocate`` returns ``claim(num_tokens, token_ids)`` as its prefix hit."""
    claim = staticmethod(lambda num_tokens, token_ids: 0)

    def __init__(self, model=MODEL, cache_bytes=64 * 2048, max_seq_len_tokens=256, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=4)
        self.name = "claims"

    def allocate(self, seq_id, num_tokens, token_ids=None, *args, **kwargs):
        super().allocate(seq_id, num_tokens, token_ids, *args, **kwargs)
        return self.claim(num_tokens, token_ids)


def claiming(claim):
    return type("Claims", (Claims,), {"claim": staticmethod(claim)})()


def admit(manager, sharing, lookup=True):
    sched = Scheduler(manager, SchedulerConfig(enable_prefix_sharing=sharing))
    sched.add_request(Request(0, PROMPT_TOKENS, 4, tuple(range(100, 100 + PROMPT_TOKENS)),
                              prefix_lookup=lookup))
    return sched


@pytest.mark.parametrize("sharing, claim", [
    (False, lambda n, ids: n),          # every prompt token "cached" without token ids (+24%)
    (False, lambda n, ids: -7),         # computes 7 tokens more, silently
    (False, lambda n, ids: None),       # was a TypeError from the scheduler's own code
    (False, lambda n, ids: "0"),
    (False, lambda n, ids: True),       # a bool is not a count
    (True, lambda n, ids: len(ids) + 1),   # more than the tokens offered
    (True, lambda n, ids: 2.0),
    (True, lambda n, ids: -1),
], ids=["all-without-ids", "negative", "none", "str", "bool", "past-ids", "float",
        "negative-with-ids"])
def test_an_impossible_prefix_hit_is_refused_naming_the_class_and_undone(sharing, claim):
    manager = claiming(claim)
    sched = admit(manager, sharing)
    with pytest.raises(ManagerContractError, match=r"policy 'claims': Claims\.allocate returned"
                                                   r" .* an int from 0 to (0|20)$") as caught:
        sched.schedule()
    assert isinstance(caught.value, PolicyError) and isinstance(caught.value, ValueError)
    limit = PROMPT_TOKENS if sharing else 0
    assert str(caught.value).endswith(f"an int from 0 to {limit}")
    # undone: the manager holds nothing, the request still waits at the head of the queue
    assert sched.state_of(0) is SeqState.WAITING
    assert manager.stats().allocated_tokens == 0 and manager.stats().live_tokens == 0
    with pytest.raises(UnknownSequenceError):
        manager.num_tokens(0)
    manager.check_integrity()


def test_a_lookup_false_request_may_not_hit():
    sched = admit(claiming(lambda n, ids: 8), sharing=True, lookup=False)
    with pytest.raises(ManagerContractError, match="with lookup=False: .* from 0 to 0$"):
        sched.schedule()


@pytest.mark.parametrize("claimed, computed", [(0, 0), (8, 8), (PROMPT_TOKENS, PROMPT_TOKENS - 1)])
def test_a_hit_within_the_offered_token_ids_is_taken_and_the_last_token_computed(claimed,
                                                                                  computed):
    sched = admit(claiming(lambda n, ids: claimed), sharing=True)
    plan = sched.schedule()
    (scheduled,) = plan.seqs
    assert scheduled.num_computed_tokens == computed
    assert scheduled.num_new_tokens == PROMPT_TOKENS - computed


def test_check_hit_bounds_follow_the_allocate_docstring():
    manager = Claims()
    check_hit(manager, 12, 16, share_from=(3, 12))          # a sibling's units: its tokens
    with pytest.raises(ManagerContractError, match="sharing 12 tokens: .* from 0 to 12$"):
        check_hit(manager, 13, 16, share_from=(3, 12))
    check_hit(manager, 10, 16, token_ids=list(range(10)))   # no more than the ids offered
    with pytest.raises(ManagerContractError, match="10 token ids: .* from 0 to 10$"):
        check_hit(manager, 11, 16, token_ids=list(range(10)))
    check_hit(manager, 0, 16)
    with pytest.raises(ManagerContractError, match="no token ids: .* from 0 to 0$"):
        check_hit(manager, 1, 16)


def lying(**changes):
    """A paged manager whose ``stats()`` (or ``kv_cache_usage()``) is changed as given."""
    class Lying(Claims):
        def stats(self):
            honest = super().stats()
            if "stats" in changes:
                return changes["stats"]
            fields = {f: changes.get(f, getattr(honest, f)) for f in honest.__dataclass_fields__}
            return MemoryStats(**fields)

        def kv_cache_usage(self):
            return changes.get("usage", super().kv_cache_usage())
    return Lying()


@pytest.mark.parametrize("changes, broken", [
    (dict(live_tokens=10**6), r"0 <= live_tokens <= allocated_tokens <= total_tokens"),
    (dict(live_tokens=-1), r"0 <= live_tokens <= allocated_tokens"),
    (dict(allocated_tokens=10**9), r"allocated_tokens <= total_tokens"),
    (dict(free_tokens=-3), r"0 <= free_tokens <= total_tokens"),
    (dict(free_tokens=10**9), r"0 <= free_tokens <= total_tokens"),
    (dict(end_waste_tokens=-5), r"end_waste_tokens >= 0"),
    (dict(bytes_per_token=0), r"bytes_per_token >= 1"),
    (dict(live_tokens=1.5), r"every count an int"),
    (dict(free_tokens=True), r"every count an int"),
    (dict(stats={"live_tokens": 1}), r"a MemoryStats"),
], ids=["live>allocated", "negative-live", "allocated>total", "negative-free", "free>total",
        "negative-waste", "zero-width", "float", "bool", "not-a-MemoryStats"])
def test_impossible_stats_are_refused_naming_the_policy_and_the_invariant(changes, broken):
    with pytest.raises(ManagerContractError,
                       match=r"^policy 'claims': Lying\.stats\(\) returned .*; required: .*"
                             + broken):
        step_figures(lying(**changes), running=0)


@pytest.mark.parametrize("usage", [1.5, -0.1, math.nan, "0.5"])
def test_a_usage_outside_zero_to_one_is_refused(usage):
    with pytest.raises(ManagerContractError, match=r"Lying\.kv_cache_usage\(\) returned .*"
                                                   r"required: a fraction in \[0, 1\]"):
        step_figures(lying(usage=usage), running=0)


def test_honest_stats_give_the_figures():
    manager = Claims()
    manager.allocate(0, 10)              # 3 blocks of 4: 10 live, 2 past the end
    util, held, usage, waste = step_figures(manager, running=1)
    assert (util, held, waste) == (10 / 12, 10 / 12, 2.0)
    assert usage == pytest.approx(12 / manager.stats().total_tokens)


ENTRIES = [TraceEntry(1100, 8, 0.05 * i, hash_ids=(1, 2, 100 + i % 3)) for i in range(12)]


class DoublesLive(PagedManager):
    """A run's policy whose stats claim twice the live tokens (kv utilisation ~200%)."""

    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=16)
        self.name = "doubles-live"

    def stats(self):
        s = super().stats()
        return MemoryStats(s.total_tokens, s.allocated_tokens, 2 * s.live_tokens + 1,
                           s.free_tokens, s.end_waste_tokens, s.bytes_per_token)


def test_a_simulation_refuses_a_custom_policy_with_impossible_stats(monkeypatch):
    monkeypatch.setitem(sys.modules, "contract_policies", sys.modules[__name__])
    config = SimConfig(policy="contract_policies:DoublesLive", cache_bytes=2 * 10**9)
    with pytest.raises(ManagerContractError, match=r"^policy 'doubles-live': DoublesLive\.stats"
                                                   r"\(\) returned .*; required: 0 <= live"):
        simulate(ENTRIES, config)


@pytest.mark.parametrize("policy", ["paged", "vmem", "reserve-max", "reserve-oracle"])
def test_built_in_managers_keep_the_contract_with_prefix_hits(policy):
    result = simulate(ENTRIES, SimConfig(policy=policy, cache_bytes=2 * 10**9))
    assert result.num_requests == len(ENTRIES)
    assert 0 < result.kv_utilization <= 1 and 0 < result.held_utilization <= 1
    sharing = policy in ("paged", "vmem")    # the shared 1,024-token prefix is hit
    assert (result.prefix_cache_hits > 0) == sharing
