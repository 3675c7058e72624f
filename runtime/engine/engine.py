"""Engine: continuous batching of a torch causal LM over the scheduler and one of our caches.

    engine = Engine(model, cache="vmem", max_batch=16, max_context=1024)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=32))
    for ev in engine.stream(prompts, params): print(ev.request_id, ev.token_id)

One step, one StepTransaction over scheduler + manager + executor (runtime/transaction.py):
begin -> plan = scheduler.schedule() -> runner.execute(plan) (ops, then the model on the packed
new tokens) -> sampler -> executed (the plan's memory kept) -> scheduler.update(sampled, now) +
the outputs -> commit (``lifecycle``: the step's tokens are recorded whole or not at all). A
failed plan rolls it back (the cache has undone its memory). Nothing is lost: a request is rejected by
``add_request`` (RequestRejectedError, before it holds anything) or ends "finished", "aborted"
(``abort``) or "failed" (its plans, its forward or its sampling kept failing); preempted
sequences come back by the scheduler's rules.
"""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional

import torch

from vmemkv.runtime import memory
from vmemkv.runtime.attention import fastest_backend, get_backend
from vmemkv.runtime.kv import make_kv
from vmemkv.runtime.models import eos_token_ids
from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.runtime.interrupts import deferred_interrupts
from vmemkv.runtime.hf.attention import hold_vmemkv_attention, release_vmemkv_attention
from vmemkv.runtime.hf.support import check_model_supported
from vmemkv.runtime.transaction import StepTransaction
from vmemkv.scheduler.metrics import SampleLog
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .config import (EngineConfig, attention_needs, cache_config_for, check_engine_arguments,
                     kv_scales_for, resolved_layout)
from .tensor_parallel import (check_tensor_parallel_engine, kv_heads_per_rank, rank_kv_scales,
                              start_tensor_parallel)
from .call_checks import check_callback, check_tokenizer
from .errors import EngineClosedError, EngineConfigError, TensorParallelError
from .lifecycle import RequestLifecycle
from .adapters import EngineAdapters
from .beam import BeamSearches, BeamSearching
from .elastic import ElasticMemory, budget_share_for
from .statistics import EngineStatistics
from .model_runner import ModelRunner
from .outputs import TokenEvent
from .request_state import RequestState, SampleRecord, deliver
from .sampler import SampleState, Sampler, save_generators
from .self_check import self_check
from .submission import RequestSubmission, single_threaded

log = logging.getLogger("vmemkv.engine")
_ENGINE_NUMBERS = itertools.count(1)   # budget share names (a tie between shares goes by name)


@single_threaded
class Engine(RequestSubmission, RequestLifecycle, EngineStatistics, BeamSearching, ElasticMemory):
    """Runs ``model`` (an HF causal LM, e.g. LlamaForCausalLM, Qwen2ForCausalLM) with the
    scheduler on a vmem or paged cache. See EngineConfig for every option; keyword arguments
    override fields of ``config``. ``tokenizer`` (optional) enables text prompts and outputs.
    Requests enter by ``add_request`` or a batch (``generate``, ``chat``, ``stream``;
    submission.py); ``beam_search`` runs beam search (runtime/engine/beam.py)."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, config: Optional[EngineConfig] = None,
                 driver=None, memory_budget=None, **options) -> None:
        check_engine_arguments(model, config)
        check_tokenizer(tokenizer)   # a name ("gpt2") was taken, then failed inside a step
        try:
            self.config = cfg = replace(config or EngineConfig(), **options)
        except TypeError as error:
            raise EngineConfigError(f"unknown engine option: {error}") from None
        self.model, self.tokenizer = model, tokenizer
        self._closed = False     # close() sets it; add_request then refuses (EngineClosedError)
        # one thread at a time; open streams' events; requests close() ended (submission.py)
        self._guard, self._sinks, self._ended_by_close = threading.RLock(), {}, set()
        self._forgotten: List[int] = []   # closed streams' requests, to drop (submission.py)
        self._calls_inside = 0            # guarded calls under way on the thread inside
        param = next(model.parameters())
        self.device, self.vocab_size = param.device, model.config.get_text_config().vocab_size
        check_model_supported(model, cfg.max_context)   # before anything is built
        check_tensor_parallel_engine(model, cfg, param.device)
        # "user", "checkpoint", "calibrated" or "first-write" (None: unscaled); calibration runs
        # the model once, on its own attention, before anything is built
        scales, self.kv_scales_source = kv_scales_for(model, tokenizer, cfg, param)
        full_config = cache_config_for(model, cfg, param, scales=scales)
        world = cfg.tensor_parallel_size
        self.cache_config = (full_config if world == 1 else cache_config_for(   # rank 0's share
            model, cfg, param, kv_heads_per_rank(model.config, world),
            scales=rank_kv_scales(full_config.kv_scales, model.config, 0, world)))
        self.config = cfg = resolved_layout(cfg, self.cache_config)   # "auto": by the rank's pages
        if self.kv_scales_source:
            log.info("kv_cache_dtype %s: scales from %s", cfg.kv_cache_dtype,
                     self.kv_scales_source)
        kv_dtype = self.cache_config.storage_dtype   # kv_cache_dtype
        self.attention = cfg.attention if cfg.attention is not None else fastest_backend(
            cfg.cache, self.device.type, cfg.block_size, dtype=self.cache_config.dtype,   # "":
            kv_dtype=kv_dtype, **attention_needs(model, full_config))   # a name, not the default
        backend = get_backend(self.attention)
        # refuse, before any memory is built, a backend that cannot run this model's attention
        backend.check_runs(cfg.cache, self.device.type, self.cache_config.dtype, what="the model",
                           kv_dtype=kv_dtype)
        with memory.PROMISES_LOCK:   # no other engine's check or resize runs from the first check
            share = self._build_kv(model, backend, full_config, driver, memory_budget)  # to tracked
        self.cache = self.kv       # the cache (self.kv.cache) with its manager, for callers
        try:
            self._build_rest(model, backend)
        except BaseException:
            self._close_memory()   # a failed construction leaves no memory behind
            self._leave_budget()
            self._release_attention()
            raise
        self.scheduler.use_budget(share)   # None: fixed; a budget grows it up to its reach

    def _build_kv(self, model: torch.nn.Module, backend, full_config, driver, memory_budget):
        """Check the memory, build the KV cache (every rank's), track its promises; the share."""
        cfg, cache_bytes = self.config, self._checked_cache_bytes(memory_budget)
        # the model's own attention, read and counted under its lock (TP: ranks run shard copies)
        self._holds_attention = cfg.tensor_parallel_size == 1
        own = hold_vmemkv_attention(model, self) if self._holds_attention else None
        self.tp, share = None, None
        try:   # registered last, left on every failure below (Ctrl-C included)
            if cfg.self_check:   # the model is back on its own attention afterwards
                self_check(model, full_config, cfg, backend,
                           own or model.config._attn_implementation)
            share = budget_share_for(memory_budget, cfg, cache_bytes,
                                     f"{model.config.model_type}-{next(_ENGINE_NUMBERS)}")
            kv_options = dict(cache_bytes=cache_bytes, layout=cfg.layout,
                              page_bytes=cfg.page_bytes, block_size=cfg.block_size,
                              swap_bytes=cfg.swap_bytes, prefix_eviction=cfg.prefix_eviction,
                              background_mapper=cfg.background_mapper,   # vmem only
                              max_cache_bytes=share.max_bytes if share else cfg.max_cache_bytes)
            if cfg.tensor_parallel_size > 1:   # every rank builds its shard and cache; rank 0 here
                self.tp = start_tensor_parallel(model, cfg, self.cache_config, kv_options,
                                                self.attention, driver, full_config)
                self.kv = self.tp.kv
            else:
                self.kv = make_kv(self.cache_config, cfg.cache, driver=driver, **kv_options)
            self._init_elastic(share)
        except BaseException:
            if share is not None:
                share.unregister()
            self._release_attention()
            raise
        return share

    def _build_rest(self, model: torch.nn.Module, backend) -> None:
        cfg = self.config
        # executes plans only; with TP, rank 0's shard (self.tp runs the plan on every rank)
        self.runner = (self.tp.executor.runner if self.tp is not None
                       else ModelRunner(model, self.kv.cache, backend, cfg.max_context))
        self.scheduler = Scheduler(self.kv.manager, SchedulerConfig(
            max_running=cfg.max_batch, max_tokens_per_step=cfg.max_tokens_per_step,
            watermark=cfg.watermark, preemption=cfg.preemption, max_seq_len=cfg.max_context,
            enable_prefix_sharing=cfg.prefix_sharing, check_every_step=cfg.check_integrity),
            tables=self.kv.tables)
        self.sampler = Sampler()
        self.eos_ids = eos_token_ids(model, self.tokenizer)
        self._rng = random.Random(cfg.seed)
        self._samples: Dict[int, SampleRecord] = {}  # seq_id -> sample state (unfinished)
        self._beams = BeamSearches()                 # live beam groups (their seqs: not samples)
        self._beam_rows: Dict[int, int] = {}         # this step's beams: seq_id -> logits row
        self._beam_picked: dict = {}                 # ... and their selection (beam.py)
        self._requests: Dict[int, RequestState] = {}  # request_id -> state, until collected
        self._prompt_logprobs: Dict[int, RequestState] = {}   # seq_id -> request computing
        self.runner.prompt_rows = self._prompt_logprobs       # its prompt logprobs
        self._next_request = 0
        self._t0 = time.perf_counter()
        self._steps, self._step_s, self._kv_usage = 0, 0.0, SampleLog()   # per step
        self._phase_s = {"schedule": 0.0, "sample": 0.0}   # + runner.phase_s: EngineStats' split
        self._prompt_tokens = 0                      # of the requests that finished (stats)
        self._computed_tokens = 0                    # tokens whose K/V steps computed
        self._strikes: Dict[int, int] = {}          # request_id -> failed steps in a row
        self._txn = StepTransaction(self.kv.manager, self._execute, scheduler=self.scheduler)
        self._draws: list = []   # the step's generators before it sampled (undone with the step)
        self.plan_failures = 0                       # failed plan executions, all time
        self.adapters = EngineAdapters(model, self.kv.manager, self._live_adapters,
                                       hooked_model=self.runner.model,   # TP: rank 0's shard
                                       host_copies=cfg.tensor_parallel_size,
                                       kv_cache_dtype=cfg.kv_cache_dtype)
        self.runner.adapters = self.adapters
        if self.tp is not None:      # the other ranks get an adapter's weights with its load
            self.tp.host_adapter = self.adapters.host_copy

    # ---- running -------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        """Whether a step has work to do (never after ``close``)."""
        return not self._closed and self.scheduler.has_unfinished()

    @property
    def closed(self) -> bool:
        return self._closed

    def step(self) -> List[TokenEvent]:
        """Run one scheduler step as a transaction; returns the tokens it produced, in plan order.

        All or nothing: the step's tokens reach the scheduler and the outputs together, or, if
        anything raises first (KeyboardInterrupt included; with tensor parallelism a Ctrl-C
        lands after the step), neither does and the next ``step()`` computes the same tokens
        again (``lifecycle``). If the step's memory plan fails (a driver call, out of memory),
        the cache has undone it and the scheduler and manager are rolled back as they were. A
        failure is blamed on the request it belongs to (the failed op's, or the one whose
        forward or sampling fails alone); the ``max_plan_retries + 1``-th failure in a row
        blamed on one request, or its first TokenDecodeError (the tokenizer cannot decode its
        tokens), ends it "failed" (memory released, ``RequestOutput.error`` set) and the step
        returns normally. Otherwise the exception (PlanExecutionError for a plan) is raised
        with every request intact. ``on_token`` callbacks run after the step is recorded."""
        self._refuse_step_inside_step()
        self._drop_forgotten()     # streams closed by other threads meanwhile (submission.py)
        with deferred_interrupts(self.tp is not None):   # a rank cut inside a collective
            return self._step()                           # would hang every other rank

    def _step(self) -> List[TokenEvent]:
        if self._closed:
            raise EngineClosedError("step after close(): this engine's cache is released (a "
                                    "tensor-parallel rank that died closes it)")
        if self.is_sleeping:
            return []                          # asleep: requests wait for wake()
        self.rebalance_memory()
        start = time.perf_counter()
        self._draws, self.runner.ops_applied = [], False   # see lifecycle
        plan = logits = drawing = None
        try:   # one handler for the whole step: an exception may strike at any line
            self._txn.begin()
            plan = self.scheduler.schedule()
            self._phase_s["schedule"] += time.perf_counter() - start
            logits, rows = self._txn.execute(plan)
            sample_start = time.perf_counter()
            drawing = self._drawing(plan, rows)
            sampled = self._sample(logits, drawing)
            self._phase_s["sample"] += time.perf_counter() - sample_start
            events = self._record_step(plan, sampled)
        except PlanExecutionError as error:   # from the plan's memory ops: nothing is recorded
            if self._plan_failed(plan, error):
                self._step_s += time.perf_counter() - start   # its phases were counted too
                return []
            raise
        except TensorParallelError as error:
            self.abandon(error)   # a rank died or hung: requests fail, every rank's memory goes
            raise
        except BaseException as error:
            if self._step_failed(plan, logits, drawing, error):
                self._step_s += time.perf_counter() - start
                return []
            raise
        self._step_s += time.perf_counter() - start
        self._to_streams(events)
        deliver(events, self._requests)
        return events

    def _execute(self, plan):
        """Run the plan; prompt logits go to their collectors (a recomputed position keeps its
        first value, so running a step again adds nothing)."""
        logits, rows = self.tp.execute(plan) if self.tp is not None else self.runner.execute(plan)
        for seq_id, (first, prompt_logits) in self.runner.prompt_logits.items():
            self._prompt_logprobs[seq_id].record_prompt_logits(first, prompt_logits)
        return logits, rows

    def _drawing(self, plan, rows) -> Dict[int, SampleState]:
        """{seq_id: its sampling state} of every sample this step draws, in plan order, each
        pointed at its row of the logits."""
        drawing, self._beam_rows = {}, {}
        for row, i in enumerate(rows):
            s = plan.seqs[i]
            if s.seq_id in self._beams.group_of:
                self._beam_rows[s.seq_id] = row
                continue
            for seq_id in (s.seq_id,) + s.fork_ids:
                sample = drawing[seq_id] = self._samples[seq_id].sampling
                sample.logits_row = row
        return drawing

    def _sample(self, logits, drawing: Dict[int, SampleState]) -> Dict[int, int]:
        """Tokens of the samples drawing; beams are re-selected (``_beam_picked``, applied
        when the step is recorded)."""
        self._beam_picked = self._beams.select(logits, self._beam_rows) if self._beam_rows else {}
        if logits is None or not drawing:
            return {}
        self._draws = save_generators(drawing.values())   # undone if the step is not recorded
        return dict(zip(drawing, self.sampler.sample(logits, list(drawing.values()))))

    def _record(self, plan, sampled: Dict[int, int]) -> List[TokenEvent]:
        """What an executed step changes: the scheduler's sequences (``update``), the outputs
        and the counters (run inside the step transaction's recording phase)."""
        now = self._now()
        done = self._beams.apply(self.scheduler, self._beam_picked, sampled)
        finished = set(self.scheduler.update(sampled, now=now))
        for seq_id in self.runner.prompt_logits:   # every prompt position is in: stop keeping rows
            state = self._prompt_logprobs.get(seq_id)
            if state is not None and state.output.prompt_logprobs is not None:
                del self._prompt_logprobs[seq_id]
        events = self._emit(sampled, finished, now)
        events += self._beam_events(done, self._beam_picked, now)
        self._count_finished(events)
        self._computed_tokens += plan.num_new_tokens
        self._strikes.clear()
        self._steps += 1
        self._kv_usage.append(self.kv.manager.kv_cache_usage())   # cached units count as free
        return events

    def _emit(self, sampled: Dict[int, int], finished: set, now: float) -> List[TokenEvent]:
        events = []
        for seq_id, token in sampled.items():
            sample = self._samples.get(seq_id)
            if sample is None:   # a beam: its group's output is written when it is done
                continue
            req = sample.request
            text, logprobs = sample.record(token, now, seq_id in finished)
            if sample.stopped_by_text and seq_id not in finished:
                self.scheduler.finish(seq_id)   # a stop string ended it before the scheduler
                finished.add(seq_id)
            reason = None
            if seq_id in finished:
                stop = sample.stopped_by_text or token in self.scheduler.seqs[seq_id].stop_ids
                reason = "stop" if stop else "length"
                self.scheduler.forget(seq_id)
                self._end_sample(seq_id, reason)
                if not req.remaining:
                    req.output.status = "finished"
            events.append(TokenEvent(req.output.request_id, sample.index, token, reason is not None,
                                     reason, text, logprobs, sample.completion.stop_reason))
        return events

    def run_until_done(self, on_step: Optional[Callable[[List[TokenEvent]], None]] = None) -> None:
        """Step until every request has ended. A failed memory plan is retried up to
        ``config.max_plan_retries`` times in a row before its PlanExecutionError reaches the
        caller (the engine stays usable: calling this again resumes); a request that keeps
        failing ends "failed" and the others go on. EngineClosedError on a closed engine (a
        rank that died closes it) or if ``close()`` (from a callback) ended requests meanwhile;
        EngineConfigError, before any step, for an ``on_step`` neither callable nor None."""
        check_callback("on_step", on_step)
        if self._closed:   # has_unfinished() is False once closed: this would return silently
            raise EngineClosedError("run_until_done after close(): this engine's cache is released")
        with self._driving([rid for rid, s in self._requests.items() if s.remaining],
                           "run_until_done"):
            while self.has_unfinished():
                events = self._step_with_retries()
                if on_step is not None:
                    on_step(events)

    # ---- LoRA adapters (runtime/engine/adapters.py) ----------------------------------------
    def add_lora(self, name: str, path, replace: bool = False) -> None:
        """Load a PEFT LoRA adapter from ``path`` under ``name``, for requests that name it in
        ``SamplingParams.lora``. Its weights go into the KV cache's pool when a request needs
        them and leave it when idle and KV needs the pages. Refused by name (EngineConfigError
        or a LoraError, nothing changed): a taken name without ``replace``, an unsupported
        adapter, one larger than the pool; EngineClosedError after ``close``."""
        if self._closed:
            raise EngineClosedError("add_lora after close(): this engine's cache is released")
        self.adapters.add(name, path, replace=replace)

    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name``; requests already running with it finish with it."""
        self.adapters.remove(name)

    @property
    def loras(self) -> List[str]:
        """The names of the loaded adapters."""
        return self.adapters.names

    def _live_adapters(self) -> set:
        return {s.request.adapter.digest for s in self.scheduler.seqs.values()
                if s.request.adapter is not None}

    # ---- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """End every live request "aborted" (``lifecycle``: a batch call running them raises
        EngineClosedError), drop closed streams' requests, release the cache (unmaps and frees
        every page) and, the last engine on the model, switch it back to its own attention. With
        tensor parallelism, also stops every rank (each frees its cache). Idempotent; whatever
        ending the requests raises, everything is released (and the engine closed) first."""
        try:
            if not self._closed:
                self._end_live_requests()   # "aborted" (lifecycle)
        finally:
            self._closed = True
            self._close_memory()
            self._leave_budget()       # once: detaches the finalizer and unregisters
            self._release_attention()

    def _release_attention(self) -> None:
        """Count this engine off its model, once (the last one restores the model's own)."""
        if self._holds_attention:
            self._holds_attention = False
            release_vmemkv_attention(self.model, self)

    def _close_memory(self) -> None:   # TP: stops ranks 1..N-1, then frees rank 0's cache
        (self.tp if self.tp is not None else self.cache).close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

