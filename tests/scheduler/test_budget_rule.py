"""MemoryBudget's counts (scheduler/budget.py): a grow is reserved from decide to settle (two
threads decided the same unclaimed bytes), the older blocked share is yielded to (first come,
first served across shares; the oldest first, and never a share whose stamped requests
ended), the unclaimed bytes leave out the minimums, a closed share's pressure goes with it, and
a share left with only swapped sequences asks at least one resize step."""
import pytest

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import PAGE, TINY
from .test_budget_liveness_machine import resize

BPT = TINY.bytes_per_token


def lane(budget, name, held, min_tokens=32, max_tokens=256, peak=256, swap_tokens=0):
    """A growable scheduler whose pool has held ``peak`` tokens, holding ``held`` now, and its
    share of ``budget``; with ``swap_tokens`` of swap space it preempts by swapping."""
    mgr = make_manager("vmem", TINY, peak * BPT, 256, page_bytes=PAGE, layout="interleaved",
                       max_cache_bytes=max_tokens * BPT, swap_bytes=swap_tokens * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=256,
                                           preemption="swap" if swap_tokens else "recompute"))
    sched.growable = True
    sched.resize(held * BPT)
    mgr.take_ops()
    share = budget.register(name, min_tokens * BPT, max_tokens * BPT, held * BPT)
    return sched, share


def test_two_decisions_before_either_settles_never_grant_the_same_bytes():
    budget = MemoryBudget(384 * BPT, grow_fraction=0.5, clock=lambda: 0.0)
    (sa, a), (sb, b) = lanes = [lane(budget, n, 128) for n in "ab"]
    for i, (sched, _) in enumerate(lanes):
        sched.add_request(Request(i, prompt_len=150, max_tokens=10))   # 160 > 128 tokens
    targets = [share.decide(sched) for sched, share in lanes]     # as two threads would
    assert targets == [256 * BPT, None]        # both were granted the same 128 free tokens
    assert budget.stats()["unclaimed_bytes"] == 0
    a.settle(sa.manager.cache_bytes)           # a's resize failed: its reservation goes back
    assert budget.stats()["unclaimed_bytes"] == 128 * BPT
    assert b.grant(1024 * BPT) == 256 * BPT and budget.stats()["unclaimed_bytes"] == 0
    assert a.decide(sa) is None                # b's explicit resize holds it
    resize(sb, b, 256 * BPT)
    assert budget.held_bytes == budget.total_bytes == 384 * BPT


def test_the_younger_blocked_share_yields_to_the_older_preempting_if_need_be():
    """Both hold 128 tokens, both have a 250-token request: two cannot run at once. Each
    waited for the other's pages for ever (each 'needy', so neither gave)."""
    budget = MemoryBudget(384 * BPT, grow_fraction=0.5, clock=lambda: 0.0)
    (sa, a), (sb, b) = lanes = [lane(budget, n, 128) for n in "ab"]
    for i, (sched, _) in enumerate(lanes):
        sched.add_request(Request(i, prompt_len=240, max_tokens=10))
    resize(sa, a, a.decide(sa))               # a first: blocked, stamped first, grows to 256
    assert (a.blocked, a.age, sa.manager.cache_bytes) == (True, 1, 256 * BPT)
    assert b.decide(sb) is None and b.age == 2 and b.blocked
    plan = sa.schedule()                       # a runs its request: no longer blocked
    sa.update({s.seq_id: 1 for s in plan.seqs if s.sample})
    assert a.decide(sa) is None and not a.blocked and a.age == 1     # keeps its stamp
    target = b.decide(sb)                      # b cannot take what a, older, holds
    assert target is None and b.blocked
    for _ in range(12):
        sa.update({s.seq_id: 1 for s in sa.schedule().seqs if s.sample})
    assert not sa.has_unfinished()
    target = a.decide(sa)                      # a's stamped request ended: a yields b's ask:
    # what b's 250 tokens miss, not b's whole grow step (that is taken only when free)
    assert a.age == float("inf") and a.preempts and target == (256 - 122) * BPT
    resize(sa, a, target)
    resize(sb, b, b.decide(sb))
    assert sb.manager.cache_bytes == 250 * BPT
    assert budget.stats()["shares"]["a"].yields == 1


def test_unclaimed_bytes_leave_out_minimums_and_a_closed_share_takes_its_pressure_along():
    budget = MemoryBudget(384 * BPT, clock=lambda: 0.0)
    (sa, a), (sb, b) = lane(budget, "a", 256, min_tokens=0), lane(budget, "b", 64, min_tokens=64)
    resize(sb, b, 0)                          # asleep, below its minimum
    assert budget.stats()["unclaimed_bytes"] == 64 * BPT      # b's minimum is not unclaimed
    assert budget.stats()["held_bytes"] == 256 * BPT
    sb.add_request(Request(0, prompt_len=200, max_tokens=10))
    resize(sb, b, b.decide(sb))               # grows to 128: the rest of its 210 tokens
    assert sb.manager.cache_bytes == 128 * BPT and a.pressure_bytes == 82 * BPT   # on a
    b.unregister()
    assert a.pressure_bytes == 0 and budget.stats()["shares"]["a"].pressure_bytes == 0
    b.settle(64 * BPT)                        # a closed engine's late settle changes nothing
    assert budget.held_bytes == 256 * BPT and b.held_bytes == 0


def test_what_a_share_gives_counts_against_the_pressure_posted_on_it():
    """b waits for 82 tokens from a; a gives 50: b still waits for 32, then for nothing."""
    budget = MemoryBudget(384 * BPT, clock=lambda: 0.0)
    (sa, a), (sb, b) = lane(budget, "a", 256, min_tokens=0), lane(budget, "b", 64, min_tokens=64)
    resize(sb, b, 0)
    sb.add_request(Request(0, prompt_len=200, max_tokens=10))
    resize(sb, b, b.decide(sb))
    assert a.pressure_bytes == 82 * BPT
    resize(sa, a, 206 * BPT)
    assert a.pressure_bytes == 32 * BPT and a.stats.given_bytes == 50 * BPT
    resize(sa, a, 150 * BPT)
    assert a.pressure_bytes == 0 and budget.stats()["shares"]["a"].pressure_bytes == 0


def test_pressure_asks_the_others_for_the_missing_bytes_in_all_not_each():
    """c misses 146 tokens, none unclaimed: a (160 spare) is asked for all of them first, and
    b (64 spare) for none; asking each for 146 had both give for one need."""
    budget = MemoryBudget(384 * BPT, clock=lambda: 0.0)
    sa, a = lane(budget, "a", 160, min_tokens=0, max_tokens=384, peak=160)
    sb, b = lane(budget, "b", 160, min_tokens=96, max_tokens=384, peak=160)
    sc, c = lane(budget, "c", 64, min_tokens=64, max_tokens=256, peak=256)
    sc.add_request(Request(0, prompt_len=200, max_tokens=10))
    assert c.decide(sc) is None and c.blocked
    assert (a.pressure_bytes, b.pressure_bytes) == (146 * BPT, 0)


def test_a_share_one_byte_past_the_total_is_refused():
    budget = MemoryBudget(1000, clock=lambda: 0.0)
    budget.register("a", 0, 1000, 1000)
    with pytest.raises(ConfigError, match=r"share 'b': 1 bytes do not fit the budget of 1000"):
        budget.register("b", 0, 10, 1)
    assert budget.held_bytes == 1000 and list(budget.stats()["shares"]) == ["a"]


def _run_turn(sched, share, preempted=False):
    """decide, resize if asked (partial, preempting as the share says), one step."""
    before = sched.metrics.num_preemptions
    target = share.decide(sched, preempted=preempted)
    if target is not None and target != sched.manager.cache_bytes:
        resize(sched, share, min(target, sched.manager.max_cache_bytes), share.preempts)
    else:
        share.settle(sched.manager.cache_bytes)
    if sched.has_unfinished():
        sched.update({s.seq_id: 1 for s in sched.schedule().seqs if s.sample})
    return sched.metrics.num_preemptions > before


def test_a_busy_share_is_preempted_only_for_what_a_blocked_one_cannot_run_without():
    """a needs 8 tokens past its 32 and 8 are free: it runs at once. Its grow step (48 tokens,
    grow_fraction of its max) was its ask, and a stayed blocked while running on the free
    bytes: b, busy, yielded the other 40, preempting its two running requests (and gave to
    pressure what its running requests were about to grow into, past one grow step)."""
    budget = MemoryBudget(384 * BPT, idle_release_s=1.0, grow_fraction=0.125,
                          clock=lambda: 0.0)
    sa, a = lane(budget, "a", 32, min_tokens=32, max_tokens=384, peak=40)
    sb, b = lane(budget, "b", 344, min_tokens=0, max_tokens=384, peak=344)
    for i in range(2):
        sb.add_request(Request(100 + i, prompt_len=120, max_tokens=50))
    for _ in range(3):
        _run_turn(sb, b)
    assert len(sb.running) == 2 and budget.stats()["unclaimed_bytes"] == 8 * BPT
    sa.add_request(Request(1, prompt_len=36, max_tokens=4))
    preempted = {"a": False, "b": False}
    for _ in range(60):
        preempted["a"] = _run_turn(sa, a, preempted["a"])
        preempted["b"] = _run_turn(sb, b, preempted["b"])
        assert sa.running or sa.has_unfinished() is False or a.blocked
    assert not sa.has_unfinished() and not sb.has_unfinished()
    # b gave to a's pressure only what its running requests will never use (340 of 344)
    assert sb.metrics.num_preemptions == 0 and b.stats.yields == 0
    assert b.stats.given_bytes == 4 * BPT and a.stats.grown_bytes == 8 * BPT
    assert b.pressure_bytes == 0              # withdrawn: a no longer asks


def _a_waits_beside_busy_b(a_max_tokens, b_min_tokens, b_turns):
    """A budget of 256 tokens: b holds 224 and has run a 60-token request (150 to generate) for
    ``b_turns`` turns; a holds 32 (its minimum, up to ``a_max_tokens``) and has a 200-token
    request (10 to generate) just added. ((a's scheduler, share), (b's scheduler, share))."""
    budget = MemoryBudget(256 * BPT, idle_release_s=1.0, grow_fraction=0.125,
                          clock=lambda: 0.0)
    sa, a = lane(budget, "a", 32, min_tokens=32, max_tokens=a_max_tokens, peak=a_max_tokens)
    sb, b = lane(budget, "b", 224, min_tokens=b_min_tokens, max_tokens=224, peak=224)
    sb.add_request(Request(0, prompt_len=60, max_tokens=150))
    for _ in range(b_turns):
        _run_turn(sb, b)
    sa.add_request(Request(1, prompt_len=200, max_tokens=10))
    return (sa, a), (sb, b)


def test_a_share_yields_to_an_older_blocked_one_down_to_its_minimum_only():
    """a, blocked, misses 178 tokens; b holds 224 with a minimum of 64: b yields down to 64
    (preempting), never below it, though a misses more than b's 160 spare."""
    (sa, a), (sb, b) = _a_waits_beside_busy_b(a_max_tokens=256, b_min_tokens=64, b_turns=3)
    assert a.decide(sa) is None and a.blocked and a.ask_bytes == 178 * BPT
    a.settle(sa.manager.cache_bytes)
    assert b.decide(sb) == 64 * BPT and b.preempts


def test_a_blocked_share_whose_request_was_aborted_holds_nobody_back():
    """a blocks for a 210-token request, b yields to it, then a's request is aborted and a,
    with nothing left, is not stepped again: b (younger) waited for ever for the bytes a
    still 'asked' (b finished only after a's next decide)."""
    (sa, a), (sb, b) = _a_waits_beside_busy_b(a_max_tokens=224, b_min_tokens=32, b_turns=5)
    _run_turn(sa, a)
    assert a.blocked and not sa.running
    assert _run_turn(sb, b) and b.stats.yields == 1        # b yields to a, preempting
    sa.abort_request(1)
    assert not sa.has_unfinished()
    preempted = False
    for _ in range(400):                                   # only b is stepped
        preempted = _run_turn(sb, b, preempted)
        if not sb.has_unfinished():
            break
    assert not sb.has_unfinished() and sb.metrics.generated_tokens == 150


def test_a_share_left_with_only_swapped_sequences_asks_at_least_one_resize_step():
    """With only swapped sequences a share asks at least one byte more (budget_needs: what its
    head lacks is at least one byte, the pool's next resize step), even where the head's tokens
    and its room to decode fit the unused bytes: the scheduler may still not swap it in (a beam
    group needs more than its head). a's request (41 tokens, 19 to go) is swapped out by a
    shrink to 32 tokens and the pool grown back to 128: it asks, and grows by its grow step."""
    budget = MemoryBudget(384 * BPT, grow_fraction=0.125, clock=lambda: 0.0)
    sa, a = lane(budget, "a", 128, swap_tokens=256)
    sa.add_request(Request(0, prompt_len=40, max_tokens=20))
    sa.update({s.seq_id: 1 for s in sa.schedule().seqs if s.sample})
    resize(sa, a, 32 * BPT, preempt=True)
    resize(sa, a, a.grant(128 * BPT))
    assert (len(sa.running), len(sa.swapped), sa.swapped[0].length) == (0, 1, 41)
    assert sa.manager.stats().free_tokens >= 41 + 19
    assert a.decide(sa) == (128 + 32) * BPT and a.blocked and a.ask_bytes == 2 * BPT


def test_a_share_whose_stamped_request_ended_before_anyone_yielded_is_yielded_nothing():
    """Ages tie only at 'none' (no stamped sequence alive), and a share of no age is older than
    nobody: a blocks for its 210-token request, which is aborted before b decides; b, of no age
    either, yields nothing: it gives a's pressure only the 14 tokens its running request will
    never use, preempting nothing (read as an equal's, a's leftover ask had b yield down to its
    minimum, preempting its running request for a share that wants nothing)."""
    (sa, a), (sb, b) = _a_waits_beside_busy_b(a_max_tokens=224, b_min_tokens=32, b_turns=5)
    _run_turn(sa, a)
    assert a.blocked and a.ask_bytes > 0 and not sa.running and b.age == float("inf")
    sa.abort_request(1)
    assert b.decide(sb) == 210 * BPT and not b.preempts and b.stats.yields == 0


def test_a_share_yields_first_to_the_oldest_of_the_blocked_shares_older_than_it():
    """a blocks first (stamp 1, missing 178 tokens), then c (stamp 2, missing 78): b, busy with
    320 tokens, yields what a misses (down to 142), not what c, younger, misses (242)."""
    budget = MemoryBudget(384 * BPT, idle_release_s=1.0, grow_fraction=0.125,
                          clock=lambda: 0.0)
    sb, b = lane(budget, "b", 320, min_tokens=32, max_tokens=320, peak=320)
    (sa, a), (sc, c) = (lane(budget, name, 32) for name in "ac")
    sb.add_request(Request(0, prompt_len=60, max_tokens=150))
    for _ in range(3):
        _run_turn(sb, b)
    sa.add_request(Request(1, prompt_len=200, max_tokens=10))
    sc.add_request(Request(2, prompt_len=100, max_tokens=10))
    _run_turn(sa, a)
    _run_turn(sc, c)
    assert (a.age, a.ask_bytes, c.age, c.ask_bytes) == (1, 178 * BPT, 2, 78 * BPT)
    assert b.decide(sb) == (320 - 178) * BPT and b.preempts


@pytest.mark.parametrize("policy", ["paged", "reserve-max"])
def test_a_share_over_a_pool_that_cannot_resize_is_refused_by_name_before_any_change(policy):
    """Only vmem pools resize: a decision for a paged or reservation scheduler was a size
    nothing could apply (decide returned a grow target, reserved from the budget)."""
    budget = MemoryBudget(512 * BPT, clock=lambda: 0.0)
    share = budget.register("p", 32 * BPT, 256 * BPT, 128 * BPT)
    sched = Scheduler(make_manager(policy, TINY, 128 * BPT, 128),
                      SchedulerConfig(max_running=4, max_seq_len=128))
    sched.add_request(Request(0, prompt_len=100, max_tokens=20))
    before = (budget.stats(), share.idle_since, share.stamps)
    with pytest.raises(ConfigError, match=f"resizes.*got policy '{policy}'"):
        share.decide(sched)
    assert (budget.stats(), share.idle_since, share.stamps) == before
