"""MemoryBudget's counts (scheduler/budget.py): a grow is reserved from decide to settle (two
threads decided the same unclaimed bytes), the older blocked share is yielded to (first come,
first served across shares), the unclaimed bytes leave out the minimums, and a closed share's
pressure goes with it."""
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import PAGE, TINY
from .test_budget_liveness_machine import resize

BPT = TINY.bytes_per_token


def lane(budget, name, held, min_tokens=32, max_tokens=256, peak=256):
    """A growable scheduler whose pool has held ``peak`` tokens, holding ``held`` now, and its
    share of ``budget``."""
    mgr = make_manager("vmem", TINY, peak * BPT, 256, page_bytes=PAGE, layout="interleaved",
                       max_cache_bytes=max_tokens * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=256))
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
    target = a.decide(sa)                      # a's stamped request ended: a yields b's ask
    assert a.age == float("inf") and a.preempts and target == 128 * BPT
    resize(sa, a, target)
    resize(sb, b, b.decide(sb))
    assert sb.manager.cache_bytes == 256 * BPT > 250 * BPT
    assert budget.stats()["shares"]["a"].yields == 1


def test_unclaimed_bytes_leave_out_minimums_and_a_closed_share_takes_its_pressure_along():
    budget = MemoryBudget(384 * BPT, clock=lambda: 0.0)
    (sa, a), (sb, b) = lane(budget, "a", 256, min_tokens=0), lane(budget, "b", 64, min_tokens=64)
    resize(sb, b, 0)                          # asleep, below its minimum
    assert budget.stats()["unclaimed_bytes"] == 64 * BPT      # b's minimum is not unclaimed
    assert budget.stats()["held_bytes"] == 256 * BPT
    sb.add_request(Request(0, prompt_len=200, max_tokens=10))
    resize(sb, b, b.decide(sb))               # grows to 128: the rest is pressure on a
    assert sb.manager.cache_bytes == 128 * BPT and a.pressure_bytes == 72 * BPT
    b.unregister()
    assert a.pressure_bytes == 0 and budget.stats()["shares"]["a"].pressure_bytes == 0
    b.settle(64 * BPT)                        # a closed engine's late settle changes nothing
    assert budget.held_bytes == 256 * BPT and b.held_bytes == 0
