"""Several models on ONE device: each its own vmem manager, Scheduler and cost model, stepped
in global time order, their KV memory either one shared ``MemoryBudget`` (elastic) or a
static split (each ``total / N`` bytes, never resized). The same scheduler and manager code
runs in both arms; only who may hold which bytes differs.

    lanes = bursty_workload(BurstySpec(duration_s=120))   # shared_workloads: {"a": [...], ...}
    shared = simulate_shared(lanes, SharedConfig(elastic=True))
    static = simulate_shared(lanes, SharedConfig(elastic=False))
    shared.models["a"].ttft_p90_s, static.models["a"].ttft_p90_s

One model's turn, at its own clock (the model whose next event is earliest goes first):

    arrivals up to now join its queue (one longer than its pool has held fails alone, as the
             engine refuses it: ``ModelResult.failed_requests``)
    elastic: target = share.decide(scheduler, now, preempted_last_step)
             target -> Scheduler.resize(target, share.preempts, partial=True) in a
             transaction (undone on CacheResizeError; ``preempts``: a yield to an older
             blocked model, budget.py's liveness rule), share.settle(manager.cache_bytes);
             the resize's page cost (below) keeps its stream busy before the step
    one step (simulator.Simulator's: the cost model's time, dummy tokens, update)

A model with nothing to run takes a turn without a step (a budget tick) when it becomes idle,
when ``idle_release_s`` of idleness is up, and at once when another model posts pressure on it:
an idle engine's serving loop ticking its share (runtime/engine/elastic.py's rule, run by
whoever polls it). A BLOCKED model (budget.py) whose turn moved nothing waits for another
model's turn (or its next arrival) instead of stepping empty: a run in which every model waits
and no event is left is a stall, raised at once. The budget's idle clock is simulated time.

The model's limit, stated plainly: COMPUTE IS NOT CONTENDED, ONLY MEMORY IS. Each model's
steps run on their own stream at their own roofline cost, as if each had the device's whole
bandwidth; on a real GPU two models time-share it and each step would be slower while both
run. Both arms share this assumption, so their difference is the memory policy's; the absolute
latencies of either are optimistic whenever both models are busy at once.

Resize cost, charged to the model's next step (its stream is busy that long first): each page
taken back into service on growth costs one cuMemCreate + cuMemMap + cuMemSetAccess, each page
released one cuMemUnmap (published A100 figures, 2 MiB pages: ``GROW_PAGE_S``,
``RELEASE_PAGE_S``); a yield's swap preemptions copy at ``h2d_bytes_per_s``. Pessimistic for
growth: the executor creates a page when it is first mapped, so a real engine spreads (or
hides, on a mapper thread) what is charged here at once.
"""
from __future__ import annotations

from array import array
import math
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from .budget import BudgetShare, MemoryBudget
from .errors import CacheResizeError, ConfigError, RequestTooLargeError, SchedulerError
from .geometry import PageGeometry
from .managers import make_manager
from .managers.base import ReleasePages
from .report import RequestTiming, serving_report
from .scheduler import Scheduler
from .shared_config import (GROW_PAGE_S, RELEASE_PAGE_S, ModelResult, SharedConfig,  # noqa: F401
                            SharedResult, SimulationStalledError, kv_bytes_after_weights)
from .sim_memory import check_simulation_fits, pool_unit_bytes
from .simulator import Simulator, _request_maker, _sharing_config
from .workload import MAX_ARRIVAL_S, TraceEntry

PERCENTILES = (50.0, 90.0, 99.0)


class Lane:
    """One model on the device: its arrivals, scheduler, manager, clock and budget share
    (None: a static cache). ``now`` is when its stream is next free."""

    def __init__(self, name: str, model: str, entries: Sequence[TraceEntry], cache_bytes: int,
                 max_cache_bytes: int, config: SharedConfig) -> None:
        self.name, self.model, self.config = name, model, config
        self.entries = sorted(entries, key=lambda e: e.arrival_s)
        sim = config.sim_config(model, cache_bytes)
        self.manager = make_manager("vmem", sim.model_spec, cache_bytes, config.max_seq_len,
                                    page_bytes=config.page_bytes, layout=sim.resolved_layout,
                                    max_cache_bytes=max_cache_bytes)
        self.sim = Simulator(self.manager, sim.make_cost(self.manager.pages_per_map_op),
                             config.scheduler)
        self.scheduler = Scheduler(self.manager, _sharing_config(config.scheduler, self.entries))
        self.share: Optional[BudgetShare] = None
        self._make_request = _request_maker()
        self.token_times: Dict[int, array] = {}    # first seq id -> its token times
        self.admitted: List[int] = []              # entry indices, in token_times' order
        self.failed: List[str] = []                # why each request refused at arrival was
        self.now, self.nxt, self.after_idle = 0.0, 0, True
        self.preempted = False                 # the last step preempted
        self._ticked = -math.inf               # when it last took a turn without a step
        self._ticked_pressure = 0              # the pressure on its share after that turn
        self.waits = False                     # blocked, its last turn moved nothing: it waits
        self.resume_s = 0.0                    # for another lane's turn (then at its time)
        self.steps = self.pages_created = self.pages_released = 0
        self.resize_seconds = 0.0
        self.peak_cache_bytes = self.manager.cache_bytes

    # -- when this lane acts next --
    def next_time(self) -> float:
        """Its next event: now while it has work (blocked and waiting: its next arrival or
        another lane's turn); else its next arrival, or a budget tick."""
        t = self.entries[self.nxt].arrival_s if self.nxt < len(self.entries) else math.inf
        if self.waits:
            return max(t, self.now)
        if self.scheduler.has_unfinished():
            return max(self.now, self.resume_s)
        share = self.share
        if share is not None and share.held_bytes > share.min_bytes:
            if share.idle_since is None and self._ticked != self.now:
                return self.now                # becoming idle: tick now
            if share.pressure_bytes and share.pressure_bytes != self._ticked_pressure:
                return max(self.now, share.budget.clock())   # asked to give: tick now
            t = min(t, _deadline(share.idle_since, self.config.idle_release_s))
        return max(t, self.now)

    def wake(self, t: float) -> None:
        """Another lane took a turn at ``t``: a waiting lane tries again, at ``t`` or later."""
        if self.waits:
            self.waits, self.resume_s = False, t

    def act(self, t: float) -> None:
        """Its turn at ``t`` (its ``next_time``): admit, resize, step (or only tick)."""
        if t > self.now:              # only an idle or waiting lane waits for its next event
            self.now, self.after_idle = t, True
        s = self.scheduler
        before = (self.progress(), self.manager.cache_bytes, s.metrics.num_preemptions,
                  len(s.waiting), len(s.swapped))
        while self.nxt < len(self.entries) and self.entries[self.nxt].arrival_s <= self.now:
            try:   # longer than the pool has held: refused alone, as the engine's 503
                ids = self.scheduler.add_request(self._make_request(self.nxt,
                                                                    self.entries[self.nxt]))
            except RequestTooLargeError as error:
                self.failed.append(str(error))
            else:
                self.token_times[ids[0]] = array("d")   # 8 bytes a token
                self.admitted.append(self.nxt)
            self.nxt += 1
        if self.share is not None:
            self._budget_turn()
        blocked = self.share is not None and self.share.blocked and not s.running
        if s.has_unfinished():
            self._step()
        else:
            self._ticked = self.now            # one tick per instant: never spins in place
        if self.share is not None:
            self._ticked_pressure = self.share.pressure_bytes
        # a blocked lane whose turn moved nothing can move only after another lane's turn
        # (a yield, a give, a request ending): it waits for one, not spinning on empty steps
        self.waits = blocked and not s.running and before == (
            self.progress(), self.manager.cache_bytes, s.metrics.num_preemptions,
            len(s.waiting), len(s.swapped))

    def _step(self) -> None:
        before = self.scheduler.metrics.num_preemptions
        seconds, _, _, _ = self.sim._step(self.scheduler, self.now, self.token_times,
                                          self.after_idle)
        self.now += seconds
        self.after_idle = False
        self.steps += 1
        self.preempted = self.scheduler.metrics.num_preemptions > before

    # -- the budget, before a step --
    def _budget_turn(self) -> None:
        target = self.share.decide(self.scheduler, self.now, self.preempted)
        if target is None or target == self.manager.cache_bytes:
            self.share.settle(self.manager.cache_bytes)    # nothing reserved stays reserved
            return
        before = self.manager.cache_bytes
        plan = self._resize(min(target, self.manager.max_cache_bytes), self.share.preempts)
        after = self.manager.cache_bytes
        self.share.settle(after)
        if self.share.held_bytes != after:
            raise SchedulerError(f"{self.name}: share holds {self.share.held_bytes} bytes, the "
                                 f"cache {after}")
        created = max(0, after - before) // self.config.page_bytes
        released = sum(len(op.pool_pages) for op in plan.ops if type(op) is ReleasePages) \
            if plan is not None else 0
        cost = created * self.config.grow_page_s + released * self.config.release_page_s
        swapped = self.manager.swapped_bytes(plan.ops) if plan is not None and plan.ops else 0
        cost += swapped / self.sim.h2d_bytes_per_s   # a yield's swap preemptions
        self.pages_created += created
        self.pages_released += released
        self.resize_seconds += cost
        self.now += cost                       # the stream is busy resizing first
        self.peak_cache_bytes = max(self.peak_cache_bytes, after)

    def _resize(self, target: int, preempt: bool):
        """``Scheduler.resize(target, preempt, partial=True)`` as one transaction (``preempt``:
        a yield to an older blocked lane); None when it raised CacheResizeError: nothing
        changed."""
        mgr, sched = self.manager, self.scheduler
        mgr.begin()
        sched.begin()
        try:
            plan = sched.resize(target, preempt, partial=True)
        except CacheResizeError:
            sched.rollback()
            mgr.rollback()
            return None
        sched.commit()
        mgr.commit()
        return plan

    def result(self) -> ModelResult:
        timings = [RequestTiming(self.entries[i].arrival_s, times, self.entries[i].prompt_len)
                   for i, times in zip(self.admitted, self.token_times.values())]
        serving = serving_report(timings, percentiles=PERCENTILES)
        stats = self.share.stats if self.share is not None else None
        return ModelResult(
            name=self.name, model=self.model, num_requests=len(timings),
            output_tokens=self.scheduler.metrics.generated_tokens,
            ttft_p50_s=serving["p50_ttft_ms"] / 1e3, ttft_p90_s=serving["p90_ttft_ms"] / 1e3,
            output_tokens_per_s=serving["output_throughput"],
            num_preemptions=self.scheduler.metrics.num_preemptions,
            final_cache_bytes=self.manager.cache_bytes, peak_cache_bytes=self.peak_cache_bytes,
            grows=stats.grows if stats else 0, gives=stats.gives if stats else 0,
            pages_created=self.pages_created, pages_released=self.pages_released,
            resize_seconds=self.resize_seconds, num_steps=self.steps,
            failed_requests=len(self.failed), serving=serving, timings=timings)

    def progress(self) -> tuple:
        """What only grows while the lane moves: arrivals taken, tokens, requests ended."""
        m = self.scheduler.metrics
        return (self.nxt, m.generated_tokens, m.num_finished_requests)

    def waits_for(self) -> str:
        """Its state in words, for a stalled run's message."""
        s, share = self.scheduler, self.share
        head = s.swapped[0] if s.swapped else s.waiting[0] if s.waiting else None
        text = (f"{self.name}: {len(s.waiting)} waiting, {len(s.running)} running, "
                f"{len(s.swapped)} swapped, cache {self.manager.cache_bytes} bytes")
        if head is not None:
            text += f", head sequence {head.seq_id} of {head.length} tokens"
        if share is not None:
            text += (f"; share min {share.min_bytes} max {share.max_bytes}, "
                     f"{'blocked asking ' + str(share.ask_bytes) if share.blocked else 'not blocked'}"
                     f", pressure on it {share.pressure_bytes}")
        return text


def _group_bytes(sim) -> int:
    """The least a lane's pool holds: a page of every member (``VmemShape``'s check)."""
    geometry = PageGeometry.of(sim.model_spec, sim.page_bytes, sim.resolved_layout)
    return sim.page_bytes * geometry.num_members


def _deadline(idle_since: float, idle_release_s: float) -> float:
    """The first float time t with t - idle_since >= idle_release_s (decide's own test: a
    plain sum can round below it, and the tick would then find nothing to do, forever)."""
    t = idle_since + idle_release_s
    while t - idle_since < idle_release_s:
        t = math.nextafter(t, math.inf)
    return t


class SharedSimulator:
    """The lanes of ``workloads`` ({name: entries}) on one device as ``config`` says.
    Guarantees, checked every turn (SchedulerError otherwise): the shares' held bytes never
    exceed ``total_bytes`` and each manager's ``cache_bytes`` equals its share's after every
    settle; every request finishes or, refused at arrival, fails alone; a run in which no lane
    moves (no arrival, token or ending) for ``stall_turns`` turns stops with
    SimulationStalledError naming each lane's state, never loops for ever. The workloads given
    in another order (``config.models`` reordered alike) give the same results."""

    def __init__(self, workloads: Mapping[str, Sequence[TraceEntry]],
                 config: SharedConfig = SharedConfig()) -> None:
        if not workloads:
            raise ConfigError("simulate_shared needs at least one workload")
        for name, entries in workloads.items():
            if not isinstance(name, str) or not name:   # turns and ties go by name (compared)
                raise ConfigError(f"workload names must be non-empty str, got {name!r}")
            late = next((e.arrival_s for e in entries
                         if not 0 <= e.arrival_s <= MAX_ARRIVAL_S), None)
            if late is not None:
                raise ConfigError(f"workload {name!r}: an arrival at {late!r} s; arrivals must "
                                  f"be in [0, {MAX_ARRIVAL_S:.0e}] s")
        self.config = config
        models = config.model_names(len(workloads))
        total = config.total_bytes or kv_bytes_after_weights(config.device, models)
        self.total_bytes, n = total, len(workloads)
        group = max(_group_bytes(config.sim_config(m, config.page_bytes)) for m in models)
        if total // n < group:    # was refused naming cache_bytes (a lane's, not a field)
            raise ConfigError(f"total_bytes={total} leaves {n} models less than one page group "
                              f"each ({group} bytes: a page of page_bytes={config.page_bytes} "
                              f"for each member of the pool)")
        if config.elastic and config.min_fraction * n > 1:    # was lowered to total / n each
            raise ConfigError(f"min_fraction={config.min_fraction} reserves that much of "
                              f"total_bytes for each of {n} models, {config.min_fraction * n:g} "
                              f"of it in all; give at most 1/{n}")
        every = [e for entries in workloads.values() for e in entries]   # each lane's page
        check_simulation_fits(len(every), sum(e.output_len for e in every),   # tables: up to
                              "simulate fewer requests, or lower total_bytes or raise page_bytes",
                              pool_units=n * (total if config.elastic else total // n)
                              // config.page_bytes,                           # its max, each
                              unit_bytes=max(pool_unit_bytes(config.sim_config(m, total // n))
                                             for m in models))            # the most a page's
        per_lane = max(1, config.max_seq_len // max(1, config.scheduler.max_tokens_per_step))
        self.stall_turns = 10_000 + 64 * n * (per_lane + 1)   # turns without progress
        self.budget = MemoryBudget(total, config.idle_release_s, config.grow_fraction,
                                   clock=lambda: self.now) if config.elastic else None
        self.now = 0.0
        self.lanes: List[Lane] = []
        for (name, entries), model in zip(workloads.items(), models):
            lane = Lane(name, model, entries, total // n, total if config.elastic else total // n,
                        config)
            if self.budget is not None:     # min rounded down to the cache's whole pages
                held = lane.manager.cache_bytes
                lane.share = self.budget.register(name, min(int(config.min_fraction * total),
                                                            held), total, held)
                lane.scheduler.use_budget(lane.share)   # admission waits for it to grow
            self.lanes.append(lane)
        self.peak_held_bytes = self.held_bytes()

    def held_bytes(self) -> int:
        """What the models' caches may use now, summed (the budget's held bytes)."""
        return sum(lane.manager.cache_bytes for lane in self.lanes)

    def run(self, on_step: Optional[Callable[["SharedSimulator", Lane], None]] = None,
            on_finished: Optional[Callable[[int], None]] = None) -> SharedResult:
        """Every lane to completion, turns in global time order. ``on_step(self, lane)`` after
        each turn (tests); ``on_finished(n)``: requests finished since the last call."""
        wall0, done = time.perf_counter(), 0
        progress, still = None, 0
        while True:
            # equal times go by name: never by the workloads' order (who is stamped first)
            lane = min(self.lanes, key=lambda q: (q.next_time(), q.name))
            t = lane.next_time()
            if t == math.inf:
                if any(q.waits for q in self.lanes):     # nobody left to give to them
                    raise SimulationStalledError(
                        f"every model waits and none has an event left (simulated time "
                        f"{self.now:.6g} s): " + "; ".join(q.waits_for() for q in self.lanes))
                break
            self.now = t
            before = self._budget_state()
            lane.act(t)
            # a turn that moved nothing wakes nobody (two waiting lanes woke each other for
            # ever); one that only blocked (a stamp, an ask) wakes the younger, to yield to it
            if not lane.waits or self._budget_state() != before:
                for other in self.lanes:
                    if other is not lane:
                        other.wake(t)
            self._check()
            now = tuple(q.progress() for q in self.lanes)
            progress, still = now, (still + 1 if now == progress else 0)
            if still >= self.stall_turns:
                raise SimulationStalledError(
                    f"no model made progress in {still} turns (simulated time {self.now:.6g} "
                    f"s): " + "; ".join(q.waits_for() for q in self.lanes))
            if on_step is not None:
                on_step(self, lane)
            finished = sum(q.scheduler.metrics.num_finished_requests for q in self.lanes)
            if on_finished is not None and finished != done:
                on_finished(finished - done)
                done = finished
        for lane in self.lanes:
            left = len(lane.entries) - lane.scheduler.metrics.num_finished_requests - \
                len(lane.failed)
            if left:
                raise SchedulerError(f"{lane.name}: {left} of {len(lane.entries)} requests "
                                     f"unfinished")
        return self._result(time.perf_counter() - wall0)

    def _budget_state(self) -> tuple:
        """What another lane's decide reads of the budget: each share's bytes, ask and age."""
        return tuple((q.share.held_bytes, q.share.blocked, q.share.ask_bytes, q.share.age)
                     for q in self.lanes if q.share is not None)

    def _check(self) -> None:
        held = self.held_bytes()
        budget = self.budget.held_bytes if self.budget is not None else held
        if held > self.total_bytes or budget != held:
            raise SchedulerError(f"the caches hold {held} bytes, the budget counts {budget}, "
                                 f"of {self.total_bytes}")
        self.peak_held_bytes = max(self.peak_held_bytes, held)

    def _result(self, wall_s: float) -> SharedResult:
        models = {lane.name: lane.result() for lane in self.lanes}
        timings = [t for m in models.values() for t in m.timings]
        serving = serving_report(timings, percentiles=PERCENTILES)
        overall = {"num_requests": len(timings),
                   "output_tokens": sum(m.output_tokens for m in models.values()),
                   "ttft_p50_s": serving["p50_ttft_ms"] / 1e3,
                   "ttft_p90_s": serving["p90_ttft_ms"] / 1e3,
                   "output_tokens_per_s": serving["output_throughput"],
                   "num_preemptions": sum(m.num_preemptions for m in models.values()),
                   "failed_requests": sum(m.failed_requests for m in models.values()),
                   "grows": sum(m.grows for m in models.values()),
                   "gives": sum(m.gives for m in models.values())}
        return SharedResult(self.config.elastic, self.total_bytes, self.peak_held_bytes, models,
                            overall, wall_s)


def simulate_shared(workloads: Mapping[str, Sequence[TraceEntry]],
                    config: SharedConfig = SharedConfig(),
                    on_step: Optional[Callable[[SharedSimulator, Lane], None]] = None,
                    on_finished: Optional[Callable[[int], None]] = None) -> SharedResult:
    """Simulate ``workloads`` ({model name: entries}) sharing one device (SharedSimulator)."""
    return SharedSimulator(workloads, config).run(on_step, on_finished)
