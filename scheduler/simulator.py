"""The simulator: the real Scheduler and memory managers, with the cost model as the executor.

Each step: submit requests that have arrived, ``schedule()``, charge the step's cost model time,
sample a dummy token for every sampling sequence, ``update()``, and record the manager's
accounting and every request's token times. Nothing is approximated on the scheduling side;
only the model's run time is. Step means come twice: over the whole run, and over the
steady-state steps (those after which requests were still waiting: the queue, not the drain
tail, sets the batch; absent, None, when no step had a queue). The whole run's output tokens
per second is over simulated seconds, idle time between arrivals included; the steady state's
over its steps' time. Latencies come from ``report.serving_report`` (vllm bench serve's names).

Swap preemption: a step pays for the ``SwapOut`` / ``SwapIn`` ops in its plan, their K/V bytes
(``MemoryManager.swapped_bytes``) at the host-to-device bandwidth, as adapter loads are.

With ``beam_width`` every request is a beam search of that width (a beam group in the
scheduler): each step ``BeamModel`` picks every new beam's parent among the live ones, the
scheduler forks a parent picked several times and frees one picked by none, so sharing and
copy-on-write are the managers' own; a request's token times are its group's steps.

LoRA (issue 31): a request that names an adapter (``TraceEntry.adapter``) runs with it; the
scheduler acquires it at admission (the manager loads it into pool pages, evicting idle
adapters LRU when it needs room) and releases it at the end. A step pays for the ``LoadAdapter``
ops in its plan at the host-to-device bandwidth (``SimConfig.h2d_bytes_per_s``, no overlap with
compute), and reads the weights of every distinct adapter among its sequences once, at the
memory bandwidth (the roofline's weight term). ``adapter_budget_bytes`` None: adapters and KV
share one pool (S-LoRA's unified paging); an int: a static split, that many bytes for adapters
and the rest of ``cache_bytes`` for KV.
"""
from __future__ import annotations

from array import array
from contextlib import nullcontext
import random
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from .cost import AfterPrefill, CostModel, count_map_ops, prefill_pairs
from .errors import ConfigError, RequestTooLargeError, SchedulerError
from .managers.base import MemoryManager
from .profile_cost import ProfileCost
from .report import RequestTiming, serving_report
from .request import Request, SeqState
from .scheduler import Scheduler, SchedulerConfig
from .policies import is_custom
from .sim_config import DEFAULT_H2D_BYTES_PER_S, SimConfig, copy_seconds, policy_blamed
from .sim_memory import check_simulation_fits, pool_unit_bytes
from .sim_sums import AdapterSums, StepSums, step_figures
from .traces import prompt_token_ids
from .workload import TraceEntry, check_arrivals

POLICIES = ("reserve-max", "reserve-oracle", "paged", "vmem")
REPORT_PERCENTILES = (50.0, 90.0, 99.0)
DUMMY_TOKEN = 1   # the simulator's sampled token; never a stop token
TRACE_VOCAB_SIZE = 32000   # made-up prompt tokens from trace hash ids are in [1, this)


class _FailedAlone(Exception):
    def __init__(self, request_id: int) -> None:
        super().__init__(request_id)
        self.request_id = request_id


@dataclass
class SimResult:
    """What one simulated run measured. Token counts in tokens, times in seconds."""
    policy: str
    num_requests: int
    num_steps: int
    output_tokens: int
    simulated_seconds: float
    wall_seconds: float
    output_tokens_per_s: float     # output tokens / simulated seconds (idle time included)
    mean_batch: float              # sequences computed per step, mean over steps
    kv_utilization: Optional[float]    # live / allocated, mean over steps allocating any
    held_utilization: Optional[float]  # live / (live + end waste), mean over steps holding any:
                                       # running sequences only (excludes deferred/cached pages)
    kv_cache_usage_perc: float     # vLLM's: held over the cache, cached counted free; step mean
    mean_end_waste_tokens: float   # end-of-sequence waste per running sequence, mean over steps
    num_preemptions: int
    num_swap_preemptions: int
    recomputed_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    mapped_page_ops: int           # page groups mapped (vmem, cost.count_map_ops)
    copied_kv_bytes: int = 0       # K/V bytes moved by copy ops (block hits, copy-on-write)
    swapped_kv_bytes: int = 0      # K/V bytes swap preemption moved (SwapOut + SwapIn)
    swap_seconds: float = 0.0      # their time at h2d_bytes_per_s, charged to the steps
    failed_requests: int = 0       # beam searches that stopped fitting, ended "failed" alone
                                   # (left out of num_requests and the latencies)
    adapter_loads: int = 0         # LoRA: LoadAdapter ops (host to device copies)
    adapter_evictions: int = 0     # EvictAdapter ops (an idle adapter's pages given to others)
    adapter_load_bytes: int = 0    # bytes the loads copied
    adapter_load_seconds: float = 0.0   # their time at h2d_bytes_per_s, charged to the steps
    adapter_read_seconds: float = 0.0   # reading batched adapters' weights each step
    mean_adapters_resident: float = 0.0   # adapters in device memory, mean over steps
    peak_adapters_resident: int = 0
    mean_adapter_pages: float = 0.0       # pool pages (or blocks) they hold, mean over steps
    peak_adapter_pages: int = 0
    mean_step_adapters: float = 0.0       # distinct adapters among a step's sequences, mean
    sharing_saved: Optional[float] = None   # beams or n > 1 (else None): 1 - distinct
                                   # units the running sequences hold / the units they would
                                   # hold each with a private copy, both summed over steps (the
                                   # PagedAttention paper's memory saving)
    steady: Dict[str, Optional[float]] = field(default_factory=dict)   # steady_* (module
                                   # docstring; the means None without a steady step)
    serving: Dict[str, float] = field(default_factory=dict)   # report.serving_report, ms
    timings: List[RequestTiming] = field(default_factory=list, repr=False)

    def report(self, goodput_ms: Optional[Mapping[str, float]] = None,
               percentiles: Sequence[float] = REPORT_PERCENTILES) -> Dict[str, float]:
        """The serving report of this run's requests (simulated seconds), with goodput."""
        return serving_report(self.timings, goodput_ms=goodput_ms, percentiles=percentiles)

    def to_dict(self) -> dict:
        """Every scalar field, then the steady-state and serving figures, flat (no timings)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("steady", "serving", "timings")}
        d.update(self.steady)
        d.update(self.serving)
        return d


class BeamModel:
    """How beams fork and die in simulation: each step, each of a group's ``width`` new beams
    picks its parent among the live beams, the one at rank r (best first, the scheduler's
    order) with weight (r + 1) ** -skew (skew 0: evenly; large: all children of the best).
    A request's draw after an output step comes from a generator keyed by (``seed``, request
    id, step), not one stream read in scheduling order: every policy sees the same forks."""

    def __init__(self, width: int, skew: float = 1.0, seed: int = 0) -> None:
        self.width, self.skew, self.seed = width, skew, seed

    def parents(self, live: int, request_id: int = 0, step: int = 0) -> List[int]:
        """Ranks (0 = best) of the parents of request ``request_id``'s next ``width`` beams
        after its output token ``step``, sorted."""
        weights = [(r + 1) ** -self.skew for r in range(live)]
        draws = random.Random(f"{self.seed}/{request_id}/{step}")
        return sorted(draws.choices(range(live), weights=weights, k=self.width))


class Simulator:
    """Runs a workload through ``Scheduler(manager, config)`` with ``cost`` as the clock;
    ``beams``: every request a beam search that forks and prunes as the model says."""

    def __init__(self, manager: MemoryManager, cost: "CostModel | ProfileCost",
                 config: SchedulerConfig = SchedulerConfig(), beams: Optional[BeamModel] = None,
                 copy_bytes_per_s: Optional[float] = None, samples: int = 1,
                 h2d_bytes_per_s: float = DEFAULT_H2D_BYTES_PER_S):
        self.manager, self.cost, self.config, self.beams = manager, cost, config, beams
        self.h2d_bytes_per_s = h2d_bytes_per_s
        self._lora: Optional[AdapterSums] = None
        self.samples = samples                 # n per request (beams: 1)
        self._sharing = [0, 0]                 # (distinct, per-sequence) units, summed over steps
        self._after_prefill = AfterPrefill()
        device = getattr(cost, "device", None)
        # a device copy reads and writes each byte: half the memory bandwidth unless measured
        self.copy_bytes_per_s = copy_bytes_per_s or (
            device.memory_bandwidth_bytes_per_s / 2 if device is not None else None)
        self.read_bytes_per_s = device.memory_bandwidth_bytes_per_s if device is not None else None
        self.copied_bytes = self.swapped_bytes = 0
        self.swap_seconds = 0.0
        self._sched: Optional[Scheduler] = None   # the last run's

    def running_ids(self) -> List[int]:
        """The sequences the last run's scheduler runs (where it stopped, if it failed)."""
        return [] if self._sched is None else [s.seq_id for s in self._sched.running]

    def run(self, entries: Sequence[TraceEntry],
            on_finished: Optional[Callable[[int], None]] = None) -> SimResult:
        """Simulate ``entries`` to completion. ``on_finished(n)`` is called with the number of
        requests finished since the last call (for a progress bar). Every request finishes."""
        check_arrivals(entries, "arrival_s")      # past it the float clock loses milliseconds
        wall0 = time.perf_counter()
        self._after_prefill = AfterPrefill()
        self._times: Dict[int, List[float]] = {}
        entries = sorted(entries, key=lambda e: e.arrival_s)
        sched = self._sched = Scheduler(self.manager, _sharing_config(self.config, entries))
        self._lora = AdapterSums(entries) if any(e.adapter is not None for e in entries) else None
        make_request = _request_maker(self.beams.width if self.beams else 0, self.samples)
        self._sharing = [0, 0]
        whole, steady = StepSums(), StepSums()
        token_times: Dict[int, array] = {}             # seq_id -> its request's token times
        n, nxt, now, maps, done_reported = len(entries), 0, 0.0, 0, 0
        idle = True                                     # the next step follows idle time
        failed_ids: set = set()                         # requests ended "failed" (beams only)
        while True:
            while nxt < n and entries[nxt].arrival_s <= now:
                e = entries[nxt]
                ids = sched.add_request(make_request(nxt, e))
                token_times[ids[0]] = self._times[nxt] = array("d")   # by first seq id, request id
                nxt += 1
            if not sched.has_unfinished():
                if nxt == n:
                    break
                now, idle = entries[nxt].arrival_s, True
                continue
            try:
                seconds, mapped, batch, tokens = self._guarded_step(sched, now, token_times, idle)
            except _FailedAlone as failed:
                failed_ids.add(failed.request_id)
                continue
            idle = False
            now += seconds
            maps += mapped
            figures = step_figures(self.manager, len(sched.running))
            whole.add(batch, figures, seconds, tokens)
            if sched.waiting:
                steady.add(batch, figures, seconds, tokens)
            if on_finished is not None and sched.metrics.num_finished_requests != done_reported:
                on_finished(sched.metrics.num_finished_requests - done_reported)
                done_reported = sched.metrics.num_finished_requests
        ended = sched.metrics.num_finished_requests + len(failed_ids)
        if ended != n:
            raise SchedulerError(f"simulation ended with {n - ended} of {n} requests unfinished")
        width = self.beams.width if self.beams else self.samples   # sequences a request runs
        timings = [RequestTiming(e.arrival_s, times, e.prompt_len, width) for i, (e, times)
                   in enumerate(zip(entries, token_times.values())) if i not in failed_ids]
        result = self._result(sched, timings, (whole, steady), now, time.perf_counter() - wall0,
                              maps)
        result.failed_requests = len(failed_ids)
        return result

    def _guarded_step(self, sched: Scheduler, now: float, token_times, idle: bool) -> tuple:
        """``_step``; with beam search, in a transaction: a beam group that stops fitting at
        run time (diverging beams each copy their newest page; RequestTooLargeError naming its
        request) ends "failed" alone, its memory released, as the engine ends it, and the
        others go on (_FailedAlone). Without beams no request can stop fitting once admitted."""
        if self.beams is None:
            return self._step(sched, now, token_times, idle)
        sched.begin()
        self.manager.begin()
        try:
            out = self._step(sched, now, token_times, idle)
        except RequestTooLargeError as error:
            sched.rollback()
            self.manager.rollback()
            if error.request_id is None:
                raise
            for seq_id in sched.abort_request(error.request_id, SeqState.FAILED):
                sched.forget(seq_id)
            self.manager.take_ops()                # a simulation executes no plan
            raise _FailedAlone(error.request_id) from error
        except BaseException:
            sched.rollback()
            self.manager.rollback()
            raise
        sched.commit()
        self.manager.commit()
        return out

    def _step(self, sched: Scheduler, now: float, token_times: Dict[int, List[float]],
              after_idle: bool = False) -> tuple:
        """One scheduled step ending at ``now`` + its cost: (seconds, page groups mapped, sequences
        computed, tokens sampled); each sampled token's time goes to its request's list.
        ``after_idle``: the step follows time with nothing to run (its cost may say more)."""
        plan = sched.schedule()
        mapped, pairs = count_map_ops(plan.ops), prefill_pairs(plan.seqs)
        seconds = self.cost.step_seconds(plan.num_context_tokens, plan.num_new_tokens,
                                         mapped * self.cost.pages_per_map_op, len(plan.seqs),
                                         pairs, self._after_prefill.cold(pairs, len(plan.seqs)),
                                         after_idle)
        if self.beams is not None or self.samples > 1:
            distinct, summed = self.manager.sharing_units([q.seq_id for q in sched.running])
            self._sharing[0] += distinct
            self._sharing[1] += summed
        copied = self.manager.copied_bytes(plan.ops) if plan.ops else 0
        if copied:
            self.copied_bytes += copied
            seconds += copy_seconds(copied, self.copy_bytes_per_s)
        swapped = self.manager.swapped_bytes(plan.ops) if plan.ops else 0
        if swapped:
            self.swapped_bytes += swapped
            self.swap_seconds += swapped / self.h2d_bytes_per_s
            seconds += swapped / self.h2d_bytes_per_s
        if self._lora is not None:
            seconds += self._lora.step(plan, self.h2d_bytes_per_s, self.read_bytes_per_s)
        end = now + seconds
        if self.beams is not None:
            return seconds, mapped, len(plan.seqs), self._beam_step(sched, plan, end, token_times)
        sampled = {}
        for s in plan.seqs:
            if s.sample:
                sampled[s.seq_id] = DUMMY_TOKEN
                times = token_times.get(s.seq_id)   # a request's first sample's times (n > 1:
                if times is not None:               # its other samples are not timed)
                    times.append(end)
                if s.fork_ids:                      # n > 1: the samples forked after the prompt
                    sampled.update(dict.fromkeys(s.fork_ids, DUMMY_TOKEN))
        for seq_id in sched.update(sampled, end):   # only live sequences' records are kept,
            sched.forget(seq_id)                     # as in a server: memory per live token
        return seconds, mapped, len(plan.seqs), len(sampled)

    def _beam_step(self, sched: Scheduler, plan, end: float, token_times) -> int:
        """Every group that sampled picks its next beams (``BeamModel``); returns the tokens
        sampled. A group's time goes to its request's list (keyed by its first seq id)."""
        groups: Dict[int, List[int]] = {}
        for s in plan.seqs:
            if s.sample:
                groups.setdefault(sched.seqs[s.seq_id].request.request_id, []).append(s.seq_id)
        sampled, gone, branches, unforked = {}, [], [], 0
        for members in groups.values():
            first = sched.seqs[members[0]]
            self._times[first.request.request_id].append(end)
            if len(first.output) + 1 >= first.max_tokens:   # the last token: update finishes
                sampled.update(dict.fromkeys(members, DUMMY_TOKEN))   # every beam
                # output_len 1: the lone prompt's step is the last; the engine returns width
                # one-token hypotheses from it (beam_select: every candidate hits), never forked
                unforked += self.beams.width - len(members)
                continue
            ranks = self.beams.parents(len(members), first.request.request_id, len(first.output))
            gone += [m for r, m in enumerate(members) if r not in ranks]
            branches += [(members[r], ranks.count(r) - 1) for r in dict.fromkeys(ranks)]
            sampled.update(dict.fromkeys((members[r] for r in ranks), DUMMY_TOKEN))
        sched.prune(gone)                  # first: a fork may need a freed slot
        for parent, count in branches:
            sampled.update(dict.fromkeys(sched.branch(parent, count), DUMMY_TOKEN))
        for seq_id in sched.update(sampled, end):   # the finished and the pruned
            sched.forget(seq_id)
        sched.metrics.generated_tokens += unforked
        return len(sampled) + unforked

    def _result(self, sched: Scheduler, timings: List[RequestTiming], sums: tuple,
                sim_s: float, wall_s: float, maps: int) -> SimResult:
        m, (whole, steady) = sched.metrics, sums
        steady_means = {f"steady_{k}": v for k, v in steady.means().items()}
        steady_means.update(steady_steps=steady.steps, steady_seconds=steady.seconds)
        whole_means = dict(whole.means(), output_tokens_per_s=whole.tokens / sim_s if sim_s else 0.0)
        return SimResult(
            policy=self.manager.name, num_requests=len(timings), num_steps=whole.steps,
            output_tokens=m.generated_tokens, simulated_seconds=sim_s, wall_seconds=wall_s,
            **whole_means,
            num_preemptions=m.num_preemptions, num_swap_preemptions=m.num_swap_preemptions,
            recomputed_tokens=m.recomputed_tokens,
            prefix_cache_queries=self.manager.prefix_queries,
            prefix_cache_hits=self.manager.prefix_hits, mapped_page_ops=maps,
            copied_kv_bytes=self.copied_bytes, swapped_kv_bytes=self.swapped_bytes,
            swap_seconds=self.swap_seconds,
            sharing_saved=(1 - self._sharing[0] / self._sharing[1] if self._sharing[1] else
                           0.0) if self.beams is not None or self.samples > 1 else None,
            **(self._lora.figures() if self._lora is not None else {}),
            steady=steady_means, serving=serving_report(timings, percentiles=REPORT_PERCENTILES),
            timings=timings)


def _sharing_config(config: SchedulerConfig, entries: Sequence[TraceEntry]) -> SchedulerConfig:
    """Prefix sharing on when the trace names its prompt blocks (Mooncake hash ids)."""
    if any(e.hash_ids for e in entries):
        return replace(config, enable_prefix_sharing=True)
    return config


def _request_maker(beam_width: int = 0, n: int = 1) -> Callable[[int, TraceEntry], Request]:
    """Requests from trace entries; an entry with hash ids carries prompt token ids made up
    from them (equal ids, equal tokens: the trace's real sharing), memoised per prompt.
    ``beam_width`` > 0: each a beam group of that width; ``n``: samples per request."""
    memo: Dict[tuple, tuple] = {}

    def make(request_id: int, e: TraceEntry) -> Request:
        ids = None
        if e.hash_ids:
            key = (e.hash_ids, e.prompt_len)
            ids = memo.get(key)
            if ids is None:
                ids = memo[key] = prompt_token_ids(e, TRACE_VOCAB_SIZE)
        return Request(request_id, e.prompt_len, e.output_len, prompt_token_ids=ids,
                       arrival_s=e.arrival_s, beam_width=beam_width, n=n, adapter=e.adapter)
    return make


def simulate(entries: Sequence[TraceEntry], config: SimConfig = SimConfig(),
             on_finished: Optional[Callable[[int], None]] = None) -> SimResult:
    """Build the manager and cost model ``config`` names and simulate ``entries``, a list or
    tuple of TraceEntry (else ConfigError naming ``entries``; ``traces.load_trace`` reads a
    file), on the scheduler config with ``config.watermark_scope`` applied. A custom policy
    that fails is a PolicyError naming it (``sim_config.policy_blamed``)."""
    bad = -1 if not isinstance(entries, (list, tuple)) else next(   # -1: not a list at all
        (i for i, e in enumerate(entries) if not isinstance(e, TraceEntry)), None)
    if bad is not None:
        what = f" holding a {type(entries[bad]).__name__} at {bad}" if bad >= 0 else ""
        raise ConfigError(f"simulate's entries must be a list or tuple of TraceEntry (traces."
                          f"load_trace reads a trace file), got {type(entries).__name__}{what}")
    check_simulation_fits(len(entries), sum(e.output_len for e in entries),
                          "simulate fewer requests (--requests, or --max-requests of a trace), "
                          "fewer samples or beams (--n, --beam-width), or on larger pages or "
                          "blocks", pool_units=config.pool_units, n=config.n,
                          beam_width=config.beam_width, unit_bytes=pool_unit_bytes(config))
    config.check_copy_bandwidth(entries)        # a profile's trace with hash ids: copies
    manager, sim = config.make_manager(), None
    with (policy_blamed(config.policy, type(manager), manager, lambda: sim.running_ids() if sim
                        else []) if is_custom(config.policy) else nullcontext()):
        beams = BeamModel(config.beam_width, config.beam_skew, config.beam_seed) \
            if config.beam_width else None
        sim = Simulator(manager, config.make_cost(manager.pages_per_map_op),
                        config.scheduler_for(manager), beams, config.copy_bytes_per_s, config.n,
                        config.h2d_bytes_per_s)
        result = sim.run(entries, on_finished)
    result.policy = config.policy_name(manager)
    return result
