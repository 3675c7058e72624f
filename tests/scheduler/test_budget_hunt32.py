"""MemoryBudget, an engine's share and the several-models simulator refuse by name what they
cannot honour (hunt 32), and three pools on one budget with the engine's explicit calls (sleep,
wake, resize_cache, close) between their turns stay accounted and live."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.errors import EngineConfigError
from vmemkv.runtime.models import build_model
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError, ConfigError, RequestTooLargeError
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig
from vmemkv.scheduler.shared_sim import SharedConfig, SharedSimulator, simulate_shared
from vmemkv.scheduler.workload import TraceEntry

from ..hypothesis_budget import examples

TINY = get_model("tiny")           # 4,096 bytes a token
BPT = TINY.bytes_per_token
PAGE = 4096
MiB = 2**20


def _lane(budget, name, held_tokens=32, max_tokens=96):
    mgr = make_manager("vmem", TINY, held_tokens * BPT, 64, page_bytes=PAGE,
                       layout="per-layer", max_cache_bytes=max_tokens * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=64))
    share = budget.register(name, 0, max_tokens * BPT, held_tokens * BPT)
    sched.use_budget(share)
    return sched, share


@pytest.mark.parametrize("name", [5, None, "", b"a"], ids=["int", "none", "empty", "bytes"])
def test_a_share_name_that_is_not_a_non_empty_str_is_refused_and_nothing_registers(name):
    # accepted: a share named 5 beside one named "x" made a third's decide raise TypeError
    # comparing the names (pressure on equally spare shares goes by name), stamped and blocked
    budget = MemoryBudget(96 * BPT)
    with pytest.raises(ConfigError, match=rf"^a MemoryBudget share's name must be a non-empty "
                                          rf"str, got {name!r}$".replace("(", r"\(")):
        budget.register(name, 0, 96 * BPT, 32 * BPT)
    assert budget.stats()["shares"] == {} and budget.held_bytes == 0


def test_shares_with_equal_spare_bytes_are_asked_by_name_without_error():
    budget = MemoryBudget(96 * BPT)
    lanes = [_lane(budget, name) for name in ("x", "w", "v")]
    sched, share = lanes[2]
    sched.add_request(Request(0, prompt_len=60, max_tokens=4))
    assert share.decide(sched, now=0.0) is None     # nothing unclaimed: all asked of the others
    share.settle(32 * BPT)
    assert (share.blocked, share.ask_bytes) == (True, 32 * BPT)
    assert [s.pressure_bytes for _, s in lanes] == [0, 32 * BPT, 0]   # w before x, by name


@pytest.mark.parametrize("name", [1, None], ids=["int", "none"])
def test_a_workload_name_that_is_not_a_str_is_refused_by_name(name):
    # simulate_shared({1: ..., "b": ...}) raised TypeError comparing the names mid-run
    entries = [TraceEntry(20, 10, 0.0)]
    with pytest.raises(ConfigError, match=rf"^workload names must be non-empty str, got "
                                          rf"{name!r}$"):
        simulate_shared({name: entries, "b": entries},
                        SharedConfig(total_bytes=32 * PAGE, model="tiny", page_bytes=PAGE))


def test_a_budget_clock_that_is_not_a_function_is_refused_by_name():
    # accepted: the first decide raised "'NoneType' object is not callable"
    with pytest.raises(ConfigError, match=r"^MemoryBudget clock must be a function returning "
                                          r"seconds, got None$"):
        MemoryBudget(1 << 20, clock=None)


@pytest.mark.parametrize("page", [0, -1, True, 1.5], ids=["zero", "negative", "bool", "float"])
def test_a_shared_config_page_bytes_that_is_not_a_positive_int_is_refused_by_name(page):
    # page_bytes=0 passed SharedConfig and the run raised ZeroDivisionError
    with pytest.raises(ConfigError, match=rf"^page_bytes must be an int >= 1, got {page!r}$"):
        SharedConfig(total_bytes=8 * MiB, page_bytes=page)


def test_a_total_below_a_page_group_per_model_is_refused_naming_total_bytes():
    # 3 pages for two models passed the one-page check and was refused as "cache_bytes=6144
    # holds no page group of 8192 bytes": a lane's size, no field of SharedConfig
    lanes = {"a": [TraceEntry(2, 1, 0.0)], "b": [TraceEntry(2, 1, 0.0)]}
    with pytest.raises(ConfigError, match=r"^total_bytes=12288 leaves 2 models less than one "
                                          r"page group each \(8192 bytes: a page of "
                                          r"page_bytes=4096 for each member of the pool\)$"):
        SharedSimulator(lanes, SharedConfig(total_bytes=3 * PAGE, model="tiny", page_bytes=PAGE))
    done = simulate_shared(lanes, SharedConfig(total_bytes=16 * PAGE, model="tiny",
                                               page_bytes=PAGE))
    assert done.overall["num_requests"] == 2 and done.overall["failed_requests"] == 0


def test_cache_bytes_past_the_budget_names_cache_bytes_not_an_unset_minimum():
    # it said "min_cache_bytes (524288) is above the share's max" to a caller who gave none
    budget = MemoryBudget(256 * 1024)
    with pytest.raises(EngineConfigError, match=r"^cache_bytes \(524288, the default "
                                                r"min_cache_bytes\) is above the share's max "
                                                r"\(262144: max_cache_bytes, else the budget's "
                                                r"total\)"):
        Engine(build_model("tiny-llama", seed=0), memory_budget=budget, cache_bytes=512 * 1024,
               page_bytes=4096, max_context=256)
    assert budget.stats()["shares"] == {}


def test_a_request_past_the_budgets_total_can_never_fit_whatever_the_shares_max():
    # a share's max past the budget's total (max_cache_bytes 1 MiB on a 256 KiB budget): it
    # said the 104 tokens "do not fit the 64 ... at its max, 1048576 bytes, it would hold 256"
    # (retry later), though no share can ever hold more than the budget's 64 tokens
    budget = MemoryBudget(64 * BPT)
    mgr = make_manager("vmem", TINY, 32 * BPT, 256, page_bytes=PAGE, layout="per-layer",
                       max_cache_bytes=256 * BPT)
    sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=256))
    sched.use_budget(budget.register("a", 0, 256 * BPT, 32 * BPT))
    assert sched.add_request(Request(60, prompt_len=60, max_tokens=4)) == [0]
    with pytest.raises(RequestTooLargeError, match=r"^request 100: 100 prompt \+ 4 new tokens = "
                                                   r"104 tokens can never fit; the cache holds "
                                                   r"64 tokens of one sequence at most$"):
        sched.add_request(Request(100, prompt_len=100, max_tokens=4))
    assert [q.request.request_id for q in sched.waiting] == [60]


MACHINE_LANES = (("per-layer", "recompute"), ("interleaved", "swap"), ("per-layer", "swap"))
MACHINE_MAX_LEN = 200


def _resize(sched, share, cache_bytes, preempt=False, partial=True, check_fit=True) -> bool:
    """A resize in a transaction (undone on CacheResizeError: False), then settled."""
    sched.begin()
    sched.manager.begin()
    try:
        sched.resize(cache_bytes, preempt, check_fit=check_fit, partial=partial)
    except CacheResizeError:
        sched.rollback()
        sched.manager.rollback()
        share.settle(sched.manager.cache_bytes)
        return False
    sched.manager.commit()
    sched.commit()
    share.settle(sched.manager.cache_bytes)
    return True


class BudgetWithEngineCalls(RuleBasedStateMachine):
    """Three pools (32 tokens min, 256 max each) on a 512-token budget, each starting at 128:
    submissions up to 160 + 24 tokens, aborts, turns (decide, partial resize, one step), the
    idle clock, and the engine's explicit calls as runtime/engine/elastic.py makes them:
    ``sleep`` (withdraw, resize to 0 preempting), ``wake`` (grant the size before, at least
    the minimum), ``resize_cache`` (grant, or refused with the reservation given back) and
    ``close`` (unregister). After every rule: the budget's bytes are the open pools', within its
    total, no share claims more than is left (minimums included), nothing stays reserved.
    At the end every pool is woken and stepped: every request accepted and not aborted by an
    open pool finishes (none waits for ever behind a neighbour asleep, closed or resized).
    Run at 3,000 examples of 60 steps while hunting (2026-12-08): no failure."""

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.budget = MemoryBudget(512 * BPT, idle_release_s=1.0, clock=lambda: self.now)
        self.lanes = []
        for i, (layout, preemption) in enumerate(MACHINE_LANES):
            mgr = make_manager("vmem", TINY, 128 * BPT, MACHINE_MAX_LEN, page_bytes=PAGE,
                               layout=layout, swap_bytes=1024 * BPT, max_cache_bytes=256 * BPT)
            share = self.budget.register(f"lane{i}", 32 * BPT, 256 * BPT, 128 * BPT)
            sched = Scheduler(mgr, SchedulerConfig(max_running=4, max_seq_len=MACHINE_MAX_LEN,
                                                   preemption=preemption))
            sched.use_budget(share)
            self.lanes.append(dict(sched=sched, share=share, asleep=None, closed=False,
                                   accepted=[], last=0))
        self.next_id = 0
        self.aborted = set()

    def _turn(self, lane):
        pool = self.lanes[lane]
        if pool["closed"] or pool["asleep"] is not None:
            return
        sched, share = pool["sched"], pool["share"]
        p0 = sched.metrics.num_preemptions
        preempted = p0 > pool["last"]
        pool["last"] = p0
        target = share.decide(sched, preempted=preempted)
        if target is not None and target != sched.manager.cache_bytes:
            _resize(sched, share, min(target, sched.manager.max_cache_bytes), share.preempts)
            pool["last"] = sched.metrics.num_preemptions
        else:
            share.settle(sched.manager.cache_bytes)
        if sched.has_unfinished():
            plan = sched.schedule()
            sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})

    @rule(lane=st.integers(0, 2), prompt=st.integers(1, 40), new=st.integers(1, 24),
          large=st.integers(0, 3))
    def submit(self, lane, prompt, new, large):
        pool = self.lanes[lane]
        if pool["closed"]:
            return
        prompt += 40 * large
        req = Request(self.next_id, prompt_len=prompt, max_tokens=new)
        self.next_id += 1
        try:
            ids = pool["sched"].add_request(req)
        except RequestTooLargeError:
            return
        pool["accepted"].extend((req.request_id, i) for i in ids)

    @rule(lane=st.integers(0, 2), pick=st.integers(0, 10**6))
    def abort(self, lane, pick):
        pool = self.lanes[lane]
        if pool["closed"]:
            return
        sched = pool["sched"]
        live = sorted({r for r, i in pool["accepted"] if not sched.seqs[i].state.is_ended})
        if live:
            rid = live[pick % len(live)]
            sched.abort_request(rid)
            self.aborted.add(rid)

    @rule(lane=st.integers(0, 2), count=st.integers(1, 6))
    def step(self, lane, count):
        for _ in range(count):
            self._turn(lane)

    @rule(seconds=st.sampled_from([0.25, 1.5]))
    def tick(self, seconds):
        self.now += seconds

    @rule(lane=st.integers(0, 2))
    def sleep(self, lane):
        pool = self.lanes[lane]
        if pool["closed"] or pool["asleep"] is not None:
            return
        before = pool["sched"].manager.cache_bytes
        pool["share"].withdraw()
        assert _resize(pool["sched"], pool["share"], 0, preempt=True, partial=False,
                       check_fit=False)
        pool["last"] = pool["sched"].metrics.num_preemptions
        pool["asleep"] = before

    @rule(lane=st.integers(0, 2))
    def wake(self, lane):
        pool = self.lanes[lane]
        if pool["closed"] or pool["asleep"] is None:
            return
        target = pool["share"].grant(pool["asleep"])
        assert target >= min(pool["asleep"], pool["share"].min_bytes), (target, pool["asleep"])
        assert _resize(pool["sched"], pool["share"], target, partial=False, check_fit=False)
        pool["asleep"] = None

    @rule(lane=st.integers(0, 2), tokens=st.integers(0, 300), preempt=st.booleans())
    def resize_cache(self, lane, tokens, preempt):
        pool = self.lanes[lane]
        if pool["closed"] or pool["asleep"] is not None:
            return
        sched, share = pool["sched"], pool["share"]
        want = tokens * BPT
        granted = share.grant(want)
        if granted < want:
            share.settle(sched.manager.cache_bytes)
            return
        _resize(sched, share, min(want, sched.manager.max_cache_bytes), preempt, partial=False)
        pool["last"] = sched.metrics.num_preemptions

    @rule(lane=st.integers(0, 2))
    def close(self, lane):
        pool = self.lanes[lane]
        if pool["closed"] or sum(not x["closed"] for x in self.lanes) <= 1:
            return
        pool["share"].unregister()
        pool["closed"] = True

    @invariant()
    def accounted(self):
        live = [pool for pool in self.lanes if not pool["closed"]]
        stats = self.budget.stats()
        assert self.budget.held_bytes == sum(pool["sched"].manager.cache_bytes for pool in live) \
            <= self.budget.total_bytes
        assert stats["unclaimed_bytes"] >= 0, stats
        for pool in live:
            assert pool["share"].held_bytes == pool["sched"].manager.cache_bytes
            assert pool["share"].reserved_bytes == 0
            pool["sched"].manager.check_integrity()

    def teardown(self):
        for lane, pool in enumerate(self.lanes):
            if pool["asleep"] is not None:
                self.wake(lane)
        progress, still, rounds = None, 0, 0
        live = [pool for pool in self.lanes if not pool["closed"]]
        while any(pool["sched"].has_unfinished() for pool in live) and still < 60 and rounds < 6000:
            rounds += 1
            for lane in range(len(self.lanes)):
                self._turn(lane)
            self.now += 0.25
            now = tuple((pool["sched"].metrics.generated_tokens, pool["sched"].manager.cache_bytes)
                        for pool in live)
            progress, still = now, (still + 1 if now == progress else 0)
        for pool in live:
            sched = pool["sched"]
            stuck = [(r, i, sched.seqs[i].state, sched.seqs[i].length) for r, i in pool["accepted"]
                     if r not in self.aborted and sched.seqs[i].state is not SeqState.FINISHED]
            assert not stuck, (stuck, [(x["sched"].manager.cache_bytes // BPT, x["share"].blocked,
                                        x["share"].ask_bytes // BPT) for x in self.lanes])


TestBudgetWithEngineCalls = BudgetWithEngineCalls.TestCase
TestBudgetWithEngineCalls.settings = settings(max_examples=examples(40), stateful_step_count=30,
                                              deadline=None)
