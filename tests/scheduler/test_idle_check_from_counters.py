"""The scheduler's idle check: at every idle step (nothing running or swapped) it runs the
manager's ``check_idle``, read from counters, not the full ``check_integrity`` walk (O(pool):
most of a large pool's simulation). The full walk runs only where asked (``check_every_step``),
and the idle check still catches what it exists for: memory held by no live sequence."""
import pytest

from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.managers.vmem import VmemManager
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig
from vmemkv.scheduler.sim_config import SimConfig
from vmemkv.scheduler.simulator import simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

from .adapter_sched import TINY, ref

POLICIES = ["paged", "vmem", "reserve-max"]


def manager(policy, layout="per-layer", tokens=256):
    return make_manager(policy, TINY, tokens * TINY.bytes_per_token, 64, block_size_tokens=4,
                        page_bytes=4096, layout=layout)


def counted(monkeypatch, mgr, method: str) -> list:
    """Calls of ``mgr.<method>`` (each still runs), one entry per call."""
    real, calls = getattr(mgr, method), []

    def wrapper():
        calls.append(1)
        real()
    monkeypatch.setattr(mgr, method, wrapper)
    return calls


def serve_bursts(sched, bursts=3, per_burst=2) -> int:
    """Bursts of requests, each run to the end (an idle step after each); returns updates."""
    updates = 0
    for b in range(bursts):
        for i in range(per_burst):
            sched.add_request(Request(b * per_burst + i, 6 + i, 5))
        while sched.has_unfinished():
            plan = sched.schedule()
            sched.update({s.seq_id: 3 for s in plan.seqs if s.sample})
            updates += 1
    return updates


def idle_drained(policy, layout="per-layer"):
    """A scheduler that served a burst and is idle (its manager with a cached prefix where the
    policy keeps one)."""
    sched = Scheduler(manager(policy, layout), SchedulerConfig(enable_prefix_sharing=True))
    serve_bursts(sched, bursts=1)
    return sched, sched.manager


@pytest.mark.parametrize("policy", POLICIES)
def test_the_full_integrity_walk_is_not_run_at_idle_unless_asked(monkeypatch, policy):
    sched = Scheduler(manager(policy), SchedulerConfig())
    full = counted(monkeypatch, sched.manager, "check_integrity")
    serve_bursts(sched)                               # 3 idle steps
    assert len(full) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_idle_step_runs_the_idle_check(monkeypatch, policy):
    sched = Scheduler(manager(policy), SchedulerConfig())
    idle = counted(monkeypatch, sched.manager, "check_idle")
    serve_bursts(sched)
    assert len(idle) == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_check_every_step_runs_the_full_walk_after_every_update(monkeypatch, policy):
    sched = Scheduler(manager(policy), SchedulerConfig(check_every_step=True))
    full = counted(monkeypatch, sched.manager, "check_integrity")
    idle = counted(monkeypatch, sched.manager, "check_idle")
    updates = serve_bursts(sched)
    assert (len(full), len(idle)) == (updates, 3)


@pytest.mark.parametrize("policy,layout", [("paged", "per-layer"), ("vmem", "per-layer"),
                                           ("vmem", "interleaved")])
def test_a_unit_a_release_forgot_is_caught_at_the_next_idle_step(monkeypatch, policy, layout):
    sched = Scheduler(manager(policy, layout), SchedulerConfig())
    mgr, skipped = sched.manager, []
    real = mgr._unhold

    def unhold_but_the_first(unit):      # a release that forgets one unit: held by nobody
        if skipped:
            real(unit)
        else:
            skipped.append(unit)
    monkeypatch.setattr(mgr, "_unhold", unhold_but_the_first)
    sched.add_request(Request(0, 9, 2))
    with pytest.raises(AssertionError):
        while sched.has_unfinished():
            plan = sched.schedule()
            sched.update({s.seq_id: 3 for s in plan.seqs if s.sample})
    assert skipped and not sched.running          # raised at the idle step, by check_idle
    with pytest.raises(AssertionError):
        mgr.check_integrity()                     # a true leak: the full walk agrees


@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_a_page_or_block_held_by_no_group_or_sequence_is_caught(policy):
    sched, mgr = idle_drained(policy, layout="interleaved")
    mgr.check_idle()
    if policy == "paged":
        mgr._ledger.take_one(0)                  # block group 0 holds one block more
        match = "blocks held with no sequence"
    else:      # a free group made spare (no pages) without giving its pages back
        mgr._spare.append(mgr._free.pop())
        match = "pages bound to no unheld group"
    with pytest.raises(AssertionError, match=match):
        mgr.check_idle()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_sequence_the_manager_still_holds_at_idle_is_caught(policy):
    sched, mgr = idle_drained(policy)
    mgr.allocate(99, 4)                           # held, but run by no scheduler
    with pytest.raises(AssertionError, match="sequences held at idle"):
        mgr.check_idle()


@pytest.mark.parametrize("policy", ["paged", "vmem"])
def test_an_adapter_pinned_with_nothing_running_is_caught(policy):
    sched, mgr = idle_drained(policy)
    adapter = ref("a", "a", 2 * 4096)
    mgr.acquire_adapter(adapter)
    with pytest.raises(AssertionError, match="an adapter pinned with nothing running"):
        mgr.check_idle()
    mgr.release_adapter(adapter)                  # idle, resident: what idle allows
    mgr.check_idle()


def test_a_reservation_counter_left_over_is_caught():
    sched, mgr = idle_drained("reserve-max")
    mgr._held += 4
    with pytest.raises(AssertionError, match="tokens reserved at idle"):
        mgr.check_idle()


def test_the_simulation_is_the_same_with_the_full_walk_at_idle(monkeypatch):
    """The idle check changes nothing: a standard-workload run (arrivals spread out, so it is
    idle often) gives the same figures with the old full walk at every idle step."""
    entries = generate(WorkloadSpec(num_requests=60, arrival_rate=0.5))
    config, idle, real = SimConfig(policy="vmem", cache_bytes=2 * 10**9), [], VmemManager.check_idle

    def run():
        result = simulate(entries, config).to_dict()
        result.pop("wall_seconds")
        return result
    monkeypatch.setattr(VmemManager, "check_idle", lambda m: (idle.append(1), real(m)))
    cheap = run()
    assert len(idle) > 10                                # idle often
    monkeypatch.setattr(VmemManager, "check_idle", VmemManager.check_integrity)
    assert run() == cheap
