"""Several models on ONE device: each its own vmem manager, Scheduler and cost model, stepped
in global time order, their KV memory either one shared ``MemoryBudget`` (elastic) or a
static split (each ``total / N`` bytes, never resized). The same scheduler and manager code
runs in both arms; only who may hold which bytes differs.

    lanes = bursty_workload(BurstySpec(duration_s=120))   # shared_workloads: {"a": [...], ...}
    shared = simulate_shared(lanes, SharedConfig(elastic=True))
    static = simulate_shared(lanes, SharedConfig(elastic=False))
    shared.models["a"].ttft_p90_s, static.models["a"].ttft_p90_s

One model's turn, at its own clock (the model whose next event is earliest goes first):

    arrivals up to now join its queue
    elastic: target = share.decide(scheduler, now, preempted_last_step)
             target -> Scheduler.resize(target, partial=True) in a transaction (undone on
             CacheResizeError), share.settle(manager.cache_bytes); the resize's page cost
             (below) keeps its stream busy before the step
    one step (simulator.Simulator's: the cost model's time, dummy tokens, update)

A model with nothing to run takes a turn without a step (a budget tick) when it becomes idle,
when ``idle_release_s`` of idleness is up, and when another model posts pressure on it: an
idle engine's serving loop ticking its share (runtime/engine/elastic.py's rule, run by
whoever polls it). The budget's idle clock is simulated time.

The model's limit, stated plainly: COMPUTE IS NOT CONTENDED, ONLY MEMORY IS. Each model's
steps run on their own stream at their own roofline cost, as if each had the device's whole
bandwidth; on a real GPU two models time-share it and each step would be slower while both
run. Both arms share this assumption, so their difference is the memory policy's; the absolute
latencies of either are optimistic whenever both models are busy at once.

Resize cost, charged to the model's next step (its stream is busy that long first): each page
taken back into service on growth costs one cuMemCreate + cuMemMap + cuMemSetAccess, each page
released one cuMemUnmap (published A100 figures, 2 MiB pages: ``GROW_PAGE_S``,
``RELEASE_PAGE_S``). Pessimistic for growth: the executor creates a page when it is first
mapped, so a real engine spreads (or hides, on a mapper thread) what is charged here at once.
"""
from __future__ import annotations

from array import array
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .budget import BudgetShare, MemoryBudget
from .errors import CacheResizeError, ConfigError, SchedulerError
from .managers import make_manager
from .managers.base import ReleasePages
from .presets import get_device, get_model
from .report import RequestTiming, serving_report
from .scheduler import Scheduler, SchedulerConfig
from .sim_memory import check_simulation_fits
from .simulator import SimConfig, Simulator, _request_maker, _sharing_config
from .workload import TraceEntry

# Published A100 figures, per 2 MiB page (the CUDA VMM calls a vmem cache makes)
PAGE_CREATE_S = 193e-6        # cuMemCreate
PAGE_MAP_S = 1.45e-6          # cuMemMap
PAGE_SET_ACCESS_S = 36e-6     # cuMemSetAccess
PAGE_UNMAP_S = 26e-6          # cuMemUnmap
GROW_PAGE_S = PAGE_CREATE_S + PAGE_MAP_S + PAGE_SET_ACCESS_S   # a page taken into service
RELEASE_PAGE_S = PAGE_UNMAP_S                                  # a page given back
PERCENTILES = (50.0, 90.0, 99.0)


def kv_bytes_after_weights(device: str, models: Sequence[str]) -> int:
    """The device's memory less every model's weights (bytes): the KV memory of all of them
    together. No headroom for activations or the CUDA context: an upper bound."""
    left = get_device(device).memory_bytes - sum(get_model(m).weight_bytes for m in models)
    if left <= 0:
        raise ConfigError(f"the weights of {', '.join(models)} do not fit {device}'s "
                          f"{get_device(device).memory_bytes} bytes")
    return left


@dataclass(frozen=True)
class SharedConfig:
    """One device shared by several models (one per workload, in the workloads' order)."""
    elastic: bool = True                  # a shared MemoryBudget; False: total / N each, fixed
    model: str = "llama-3-8b"             # every model's preset, unless ``models`` names each
    models: Tuple[str, ...] = ()
    device: str = "h100"
    total_bytes: Optional[int] = None     # KV bytes of all models; None: kv_bytes_after_weights
    min_fraction: float = 0.25            # elastic: each share's min_bytes, of total_bytes
    idle_release_s: float = 2.0           # elastic: simulated seconds idle before giving back
    grow_fraction: float = 0.125          # elastic: the least a grow asks, of max_bytes
    grow_page_s: float = GROW_PAGE_S      # seconds per page taken into service
    release_page_s: float = RELEASE_PAGE_S   # seconds per page given back
    page_bytes: int = 2 * 2**20
    layout: str = "interleaved"           # vmem layout (interleaved: no per-layer end waste)
    max_seq_len: int = 4096
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for name in ("min_fraction", "grow_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("grow_page_s", "release_page_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be seconds >= 0, got {getattr(self, name)!r}")
        if self.total_bytes is not None and not self.total_bytes > 0:
            raise ConfigError(f"total_bytes must be > 0, got {self.total_bytes!r}")

    def model_names(self, count: int) -> Tuple[str, ...]:
        if not self.models:
            return (self.model,) * count
        if len(self.models) != count:
            raise ConfigError(f"models names {len(self.models)} presets for {count} workloads")
        return self.models

    def sim_config(self, model: str, cache_bytes: int) -> SimConfig:
        """The single-model config of one lane (its cost model, its scheduler config)."""
        return SimConfig(policy="vmem", model=model, device=self.device, cache_bytes=cache_bytes,
                         max_seq_len=self.max_seq_len, page_bytes=self.page_bytes,
                         layout=self.layout, scheduler=self.scheduler)


@dataclass
class ModelResult:
    """One model's run. Times in simulated seconds, memory in bytes."""
    name: str
    model: str
    num_requests: int
    output_tokens: int
    ttft_p50_s: float
    ttft_p90_s: float
    output_tokens_per_s: float     # output tokens / (its last token - its first arrival)
    num_preemptions: int
    final_cache_bytes: int
    peak_cache_bytes: int
    grows: int
    gives: int
    pages_created: int             # pages taken into service by growth
    pages_released: int            # pages given back (ReleasePages)
    resize_seconds: float          # the resizes' page cost, charged to its steps
    num_steps: int
    serving: Dict[str, float] = field(default_factory=dict, repr=False)
    timings: List[RequestTiming] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "timings"}


@dataclass
class SharedResult:
    """Every model's result and the device's: ``overall`` pools the requests of all."""
    elastic: bool
    total_bytes: int
    peak_held_bytes: int           # the most the models held at once (<= total_bytes, checked)
    models: Dict[str, ModelResult]
    overall: Dict[str, float]
    wall_seconds: float

    def to_dict(self) -> dict:
        return {"elastic": self.elastic, "total_bytes": self.total_bytes,
                "peak_held_bytes": self.peak_held_bytes, "overall": self.overall,
                "wall_seconds": self.wall_seconds,
                "models": {n: m.to_dict() for n, m in self.models.items()}}


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
        self.now, self.nxt, self.after_idle = 0.0, 0, True
        self.preempted = False                 # the last step preempted
        self._ticked = -math.inf               # when it last took a turn without a step
        self.steps = self.pages_created = self.pages_released = 0
        self.resize_seconds = 0.0
        self.peak_cache_bytes = self.manager.cache_bytes

    # -- when this lane acts next --
    def next_time(self) -> float:
        """Its next event: now while it has work; else its next arrival, or a budget tick."""
        if self.scheduler.has_unfinished():
            return self.now
        t = self.entries[self.nxt].arrival_s if self.nxt < len(self.entries) else math.inf
        share = self.share
        if share is not None and share.held_bytes > share.min_bytes:
            if (share.idle_since is None or share.pressure_bytes) and self._ticked != self.now:
                return self.now                # becoming idle, or asked to give: tick now
            t = min(t, _deadline(share.idle_since, self.config.idle_release_s))
        return max(t, self.now)

    def act(self, t: float) -> None:
        """Its turn at ``t`` (its ``next_time``): admit, resize, step (or only tick)."""
        if t > self.now:                       # only an idle lane waits for its next event
            self.now, self.after_idle = t, True
        while self.nxt < len(self.entries) and self.entries[self.nxt].arrival_s <= self.now:
            ids = self.scheduler.add_request(self._make_request(self.nxt, self.entries[self.nxt]))
            self.token_times[ids[0]] = array("d")   # 8 bytes a token
            self.nxt += 1
        if self.share is not None:
            self._budget_turn()
        if self.scheduler.has_unfinished():
            self._step()
        else:
            self._ticked = self.now            # one tick per instant: never spins in place

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
            return
        before = self.manager.cache_bytes
        plan = self._resize(min(target, self.manager.max_cache_bytes))
        after = self.manager.cache_bytes
        self.share.settle(after)
        if self.share.held_bytes != after:
            raise SchedulerError(f"{self.name}: share holds {self.share.held_bytes} bytes, the "
                                 f"cache {after}")
        created = max(0, after - before) // self.config.page_bytes
        released = sum(len(op.pool_pages) for op in plan.ops if type(op) is ReleasePages) \
            if plan is not None else 0
        cost = created * self.config.grow_page_s + released * self.config.release_page_s
        self.pages_created += created
        self.pages_released += released
        self.resize_seconds += cost
        self.now += cost                       # the stream is busy resizing first
        self.peak_cache_bytes = max(self.peak_cache_bytes, after)

    def _resize(self, target: int):
        """``Scheduler.resize(target, partial=True)`` as one transaction; None when it raised
        CacheResizeError (a live request that would no longer fit): nothing changed."""
        mgr, sched = self.manager, self.scheduler
        mgr.begin()
        sched.begin()
        try:
            plan = sched.resize(target, partial=True)
        except CacheResizeError:
            sched.rollback()
            mgr.rollback()
            return None
        sched.commit()
        mgr.commit()
        return plan

    def result(self) -> ModelResult:
        timings = [RequestTiming(e.arrival_s, times, e.prompt_len)
                   for e, times in zip(self.entries, self.token_times.values())]
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
            resize_seconds=self.resize_seconds, num_steps=self.steps, serving=serving,
            timings=timings)


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
    settle; every request finishes."""

    def __init__(self, workloads: Mapping[str, Sequence[TraceEntry]],
                 config: SharedConfig = SharedConfig()) -> None:
        if not workloads:
            raise ConfigError("simulate_shared needs at least one workload")
        self.config = config
        models = config.model_names(len(workloads))
        total = config.total_bytes or kv_bytes_after_weights(config.device, models)
        self.total_bytes, n = total, len(workloads)
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
                lane.scheduler.growable = True   # admission waits for the budget to grow it
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
        while True:
            lane = min(self.lanes, key=Lane.next_time)
            t = lane.next_time()
            if t == math.inf:
                break
            self.now = t
            lane.act(t)
            self._check()
            if on_step is not None:
                on_step(self, lane)
            finished = sum(q.scheduler.metrics.num_finished_requests for q in self.lanes)
            if on_finished is not None and finished != done:
                on_finished(finished - done)
                done = finished
        for lane in self.lanes:
            left = len(lane.entries) - lane.scheduler.metrics.num_finished_requests
            if left:
                raise SchedulerError(f"{lane.name}: {left} of {len(lane.entries)} requests "
                                     f"unfinished")
        return self._result(time.perf_counter() - wall0)

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
                   "grows": sum(m.grows for m in models.values()),
                   "gives": sum(m.gives for m in models.values())}
        return SharedResult(self.config.elastic, self.total_bytes, self.peak_held_bytes, models,
                            overall, wall_s)


def simulate_shared(workloads: Mapping[str, Sequence[TraceEntry]],
                    config: SharedConfig = SharedConfig(),
                    on_step: Optional[Callable[[SharedSimulator, Lane], None]] = None,
                    on_finished: Optional[Callable[[int], None]] = None) -> SharedResult:
    """Simulate ``workloads`` ({model name: entries}) sharing one device (SharedSimulator)."""
    every = [e for entries in workloads.values() for e in entries]
    check_simulation_fits(len(every), sum(e.output_len for e in every),
                          "simulate fewer requests")
    return SharedSimulator(workloads, config).run(on_step, on_finished)
