"""The simulator: the real Scheduler and memory managers, with the cost model as the executor.

Each step: submit requests that have arrived, ``schedule()``, charge the step's cost model time,
sample a dummy token for every sampling sequence, ``update()``, and record the manager's
accounting. Nothing is approximated on the scheduling side; only the model's run time is.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, Optional, Sequence

from .cost import CostModel, count_map_ops
from .errors import ConfigError, SchedulerError
from .managers.base import MemoryManager
from .managers.eviction import DEFAULT_EVICTION, make_eviction
from .geometry import LAYOUTS
from .metrics import latency_summary
from .presets import get_device, get_model
from .request import Request
from .scheduler import Scheduler, SchedulerConfig
from .traces import prompt_token_ids
from .workload import TraceEntry

POLICIES = ("reserve-max", "reserve-oracle", "paged", "vmem")
DUMMY_TOKEN = 1   # the simulator's sampled token; never a stop token
TRACE_VOCAB_SIZE = 32000   # made-up prompt tokens from trace hash ids are in [1, this)


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment: model, device, cache, policy, scheduler and cost options."""
    policy: str = "paged"
    model: str = "llama-3-8b"
    device: str = "h100"
    cache_bytes: int = 60 * 10**9         # KV cache budget on the device, bytes
    max_seq_len: int = 4096               # tokens a sequence may reach (prompt + output)
    block_size: int = 16                  # tokens per block (paged)
    page_bytes: int = 2 * 2**20           # bytes per physical page (vmem)
    layout: str = "per-layer"             # vmem page layout
    swap_bytes: int = 0                   # host swap space, bytes
    prefix_eviction: str = DEFAULT_EVICTION   # prefix cache retention: off | lru | hits
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefill_mfu: Optional[float] = None   # None: prefill costs only KV bandwidth
    map_latency_s: float = 0.0            # seconds per physical page mapped (vmem)
    paged_slowdown: float = 1.0           # KV read-time multiplier for the paged policy

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not self.cache_bytes > 0:
            raise ConfigError(f"cache_bytes must be > 0, got {self.cache_bytes!r}")
        get_model(self.model)
        get_device(self.device)
        make_eviction(self.prefix_eviction)

    def make_manager(self) -> MemoryManager:
        from .managers import make_manager
        return make_manager(self.policy, get_model(self.model), int(self.cache_bytes),
                            self.max_seq_len, block_size_tokens=self.block_size,
                            page_bytes=self.page_bytes, layout=self.layout,
                            max_slots=None, swap_bytes=int(self.swap_bytes),
                            prefix_eviction=self.prefix_eviction)

    def make_cost(self, pages_per_map_op: int = 1) -> CostModel:
        """The cost model; ``pages_per_map_op`` is the manager's (vmem: pages per group)."""
        model = get_model(self.model)
        return CostModel(model, get_device(self.device), prefill_mfu=self.prefill_mfu,
                         map_latency_s=self.map_latency_s, pages_per_map_op=pages_per_map_op,
                         kv_slowdown=self.paged_slowdown if self.policy == "paged" else 1.0)


@dataclass
class SimResult:
    """What one simulated run measured. Token counts in tokens, times in seconds."""
    policy: str
    num_requests: int
    num_steps: int
    output_tokens: int
    simulated_seconds: float
    wall_seconds: float
    output_tokens_per_s: float     # output tokens / simulated seconds
    mean_batch: float              # sequences computed per step, mean over steps
    kv_utilization: float          # live / allocated, mean over steps
    held_utilization: float        # live / (live + end waste), mean over steps: memory held by
                                   # running sequences only (excludes deferred/cached pages)
    kv_cache_usage_perc: float     # 1 - free / total, mean over steps (a fraction)
    mean_end_waste_tokens: float   # end-of-sequence waste per running sequence, mean over steps
    num_preemptions: int
    num_swap_preemptions: int
    recomputed_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    mapped_page_ops: int           # MapGroup ops executed (vmem)
    latency: Dict[str, float] = field(default_factory=dict)   # ttft_* and itl_* seconds

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("latency"))
        return d


class Simulator:
    """Runs a workload through ``Scheduler(manager, config)`` with ``cost`` as the clock."""

    def __init__(self, manager: MemoryManager, cost: CostModel,
                 config: SchedulerConfig = SchedulerConfig()):
        self.manager, self.cost, self.config = manager, cost, config

    def run(self, entries: Sequence[TraceEntry],
            on_finished: Optional[Callable[[int], None]] = None) -> SimResult:
        """Simulate ``entries`` to completion. ``on_finished(n)`` is called with the number of
        requests finished since the last call (for a progress bar). Every request finishes."""
        wall0 = time.perf_counter()
        entries = sorted(entries, key=lambda e: e.arrival_s)
        sched = Scheduler(self.manager, _sharing_config(self.config, entries))
        make_request = _request_maker()
        mgr, cost = self.manager, self.cost
        step_seconds, per_op = cost.step_seconds, cost.pages_per_map_op
        n, nxt, now = len(entries), 0, 0.0
        steps = batch_sum = maps = 0
        util_sum = held_sum = usage_sum = waste_sum = 0.0
        done_reported = 0
        while True:
            while nxt < n and entries[nxt].arrival_s <= now:
                e = entries[nxt]
                sched.add_request(make_request(nxt, e))
                nxt += 1
            if not sched.has_unfinished():
                if nxt == n:
                    break
                now = entries[nxt].arrival_s
                continue
            plan = sched.schedule()
            seqs = plan.seqs
            mapped = count_map_ops(plan.ops)
            maps += mapped
            now += step_seconds(plan.num_context_tokens, plan.num_new_tokens,
                                mapped * per_op)
            sampled = {s.seq_id: DUMMY_TOKEN for s in seqs if s.sample}
            for s in seqs:
                if s.fork_ids:
                    sampled.update(dict.fromkeys(s.fork_ids, DUMMY_TOKEN))
            sched.update(sampled, now)
            st = mgr.stats()
            steps += 1
            batch_sum += len(seqs)
            util_sum += st.live_tokens / st.allocated_tokens if st.allocated_tokens else 1.0
            usage_sum += 1.0 - st.free_tokens / st.total_tokens
            held = st.live_tokens + st.end_waste_tokens
            held_sum += st.live_tokens / held if held else 1.0
            if sched.running:
                waste_sum += st.end_waste_tokens / len(sched.running)
            if on_finished is not None and sched.metrics.num_finished_requests != done_reported:
                on_finished(sched.metrics.num_finished_requests - done_reported)
                done_reported = sched.metrics.num_finished_requests
        if sched.metrics.num_finished_requests != n:
            raise SchedulerError(f"simulation ended with {n - sched.metrics.num_finished_requests} "
                                 f"of {n} requests unfinished")
        return self._result(sched, n, steps, now, time.perf_counter() - wall0, batch_sum,
                            (util_sum, held_sum, usage_sum, waste_sum), maps)

    def _result(self, sched: Scheduler, n: int, steps: int, sim_s: float, wall_s: float,
                batch_sum: int, sums: tuple, maps: int) -> SimResult:
        m, div = sched.metrics, max(steps, 1)
        util_sum, held_sum, usage_sum, waste_sum = sums
        latency = latency_summary("ttft", m.ttft_s)
        latency.update(latency_summary("itl", m.itl_s))
        return SimResult(
            policy=self.manager.name, num_requests=n,
            num_steps=steps, output_tokens=m.generated_tokens, simulated_seconds=sim_s,
            wall_seconds=wall_s,
            output_tokens_per_s=m.generated_tokens / sim_s if sim_s else 0.0,
            mean_batch=batch_sum / div, kv_utilization=util_sum / div,
            held_utilization=held_sum / div,
            kv_cache_usage_perc=usage_sum / div, mean_end_waste_tokens=waste_sum / div,
            num_preemptions=m.num_preemptions, num_swap_preemptions=m.num_swap_preemptions,
            recomputed_tokens=m.recomputed_tokens,
            prefix_cache_queries=self.manager.prefix_queries,
            prefix_cache_hits=self.manager.prefix_hits,
            mapped_page_ops=maps, latency=latency)


def _sharing_config(config: SchedulerConfig, entries: Sequence[TraceEntry]) -> SchedulerConfig:
    """Prefix sharing on when the trace names its prompt blocks (Mooncake hash ids)."""
    if any(e.hash_ids for e in entries):
        return replace(config, enable_prefix_sharing=True)
    return config


def _request_maker() -> Callable[[int, TraceEntry], Request]:
    """Requests from trace entries; an entry with hash ids carries prompt token ids made up
    from them (equal ids, equal tokens: the trace's real sharing), memoised per prompt."""
    memo: Dict[tuple, tuple] = {}

    def make(request_id: int, e: TraceEntry) -> Request:
        ids = None
        if e.hash_ids:
            key = (e.hash_ids, e.prompt_len)
            ids = memo.get(key)
            if ids is None:
                ids = memo[key] = prompt_token_ids(e, TRACE_VOCAB_SIZE)
        return Request(request_id, e.prompt_len, e.output_len, prompt_token_ids=ids,
                       arrival_s=e.arrival_s)
    return make


def simulate(entries: Sequence[TraceEntry], config: SimConfig = SimConfig(),
             on_finished: Optional[Callable[[int], None]] = None) -> SimResult:
    """Build the manager and cost model ``config`` names and simulate ``entries``."""
    manager = config.make_manager()
    cost = config.make_cost(manager.pages_per_map_op)
    return Simulator(manager, cost, config.scheduler).run(entries, on_finished)
