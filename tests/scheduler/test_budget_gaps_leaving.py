"""MemoryBudget (scheduler/budget.py): a share that stops asking (withdraw: its engine sleeps)
takes the pressure it posted along (the neighbour kept giving pages back for nobody), and a share
left from a GC finalizer (unregister_later) changes nothing under a call holding the lock, takes
no lock itself, and is gone at the budget's next call."""
import threading

from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.request import Request

from .test_budget_liveness_machine import resize
from .test_budget_rule import BPT, lane


def _a_asked_of_by_b():
    """a holds 256 tokens running a request, nothing waiting; b (asleep at 0, below its
    minimum) grows to 128 for a 210-token request and posts the 82 it lacks on a."""
    budget = MemoryBudget(384 * BPT, clock=lambda: 0.0)
    (sa, a), (sb, b) = lane(budget, "a", 256, min_tokens=0), lane(budget, "b", 64, min_tokens=64)
    sa.add_request(Request(1, prompt_len=8, max_tokens=8))
    sa.update({s.seq_id: 1 for s in sa.schedule().seqs if s.sample})
    resize(sb, b, 0)
    sb.add_request(Request(0, prompt_len=200, max_tokens=10))
    resize(sb, b, b.decide(sb))
    assert sb.manager.cache_bytes == 128 * BPT and a.pressure_bytes == 82 * BPT
    return budget, (sa, a), (sb, b)


def test_a_share_that_stops_asking_withdraws_the_pressure_it_posted():
    budget, (sa, a), (sb, b) = _a_asked_of_by_b()
    b.withdraw()                                  # b goes to sleep: it asks nobody
    assert a.pressure_bytes == 0 and budget.stats()["shares"]["a"].pressure_bytes == 0
    assert a.decide(sa) is None                   # a gives nothing back for nobody
    a.settle(sa.manager.cache_bytes)
    assert budget.stats()["shares"]["a"].gives == 0 and a.held_bytes == 256 * BPT
    assert b.decide(sb) is None and a.pressure_bytes == 82 * BPT   # asks again: posted again


def test_a_share_left_later_changes_nothing_under_a_call_and_is_gone_at_the_next_one():
    """unregister_later is what an engine's GC finalizer calls: it may run inside a budget call
    (here a's decide, which asks its scheduler has_unfinished under the lock) on this thread or
    on another one while this one holds the lock."""
    budget, (sa, a), (sb, b) = _a_asked_of_by_b()
    seen, has_unfinished = [], sa.has_unfinished

    def finalizers_run_inside_decide():
        b.unregister_later()                      # on this thread, inside the call
        other = threading.Thread(target=lambda: seen.append(b.unregister_later()))
        other.start()                             # the lock is held here: it must not wait
        other.join(timeout=60)                    # a guard against a hang, not a wait
        seen.append((other.is_alive(), sorted(budget.stats()["shares"]), a.pressure_bytes))
        return has_unfinished()
    sa.has_unfinished = finalizers_run_inside_decide
    assert a.decide(sa) == (256 - 82) * BPT      # gives for b's pressure, as it stood
    assert seen == [None, (False, ["a", "b"], 82 * BPT)]   # nothing changed under decide
    a.settle(sa.manager.cache_bytes)              # the next call (resize skipped): b leaves
    stats = budget.stats()
    assert sorted(stats["shares"]) == ["a"] and stats["held_bytes"] == 256 * BPT
    assert a.pressure_bytes == 0 and stats["shares"]["a"].pressure_bytes == 0
    b.settle(128 * BPT)                           # its engine's late settle changes nothing
    assert budget.held_bytes == 256 * BPT
    b2 = budget.register("b", 64 * BPT, 256 * BPT)   # the name is free again
    assert b2.held_bytes == 64 * BPT and budget.stats()["unclaimed_bytes"] == 64 * BPT
