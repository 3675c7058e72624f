"""Iteration-level, first-come-first-served scheduling over one memory manager.

One step:

    plan = scheduler.schedule()     # decide who computes which tokens; manager plans memory
    executor runs plan.ops in order, applies plan.tables, then the model on plan.seqs
    scheduler.update(sampled, now)  # append sampled tokens, finish, fork n > 1 children

Order of work inside ``schedule()``:
  1. running decodes (all first give back what their windows no longer read), oldest admission
     first; each grows by one token. When one cannot grow, the most recently admitted running
     sequence is preempted (recompute or swap), possibly itself (alone in a cache that cannot
     grow: failed, unless a beam group swapped in: recomputed once, its beams sharing again).
  2. running prefills (chunked: whatever token budget is left).
  3. swapped sequences come back (FCFS) before any new admission (a growable pool's with room
     for their next token).
  4. waiting sequences are admitted FCFS while the whole sequence fits (one recomputed past
     what the pool holds whole, behind a window: its prompt) and the watermark stays free;
     the first that does not fit blocks the ones behind it (no overtaking).
A request with a LoRA adapter (``Request.adapter``, scheduler/adapters.py) pins it while a
sequence of it runs: the adapter is acquired before the sequence's memory (admission, swap-in,
fork; admitted only when both fit) and released whenever it stops running (finished, aborted,
failed, preempted, swapped out). Idle adapters give their pages to KV inside the manager's own
reclaim, before any allocation fails: so before this scheduler preempts or stops admitting.
No admission or swap-in happens in a step that preempted. Nothing is ever dropped: a request
that could never fit is rejected by ``add_request``, everything else eventually finishes.
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Tuple

from .errors import (DuplicateSequenceError, OutOfCapacityError, SchedulerError,
                     RequestTooLargeError, SwapSpaceExhaustedError, UnknownSequenceError)
from .managers.base import ManagerContractError, MemoryManager, check_hit
from .metrics import SchedulerMetrics, gauges
from .plan import PREEMPTION_MODES, ScheduledSeq, SchedulerConfig, StepPlan  # noqa: F401 (re-exported)
from .request import Request, Sequence, SeqState
from .lifecycle import Savepoint, StepTransactions, check_length, end_request
from .beam_groups import BeamGroups
from .pool_reach import PoolReach
from .recording import StepRecording
from .adapters import adapter_pool_bytes, check_adapter_fits
from .tables import TableTracker


class Scheduler(PoolReach, StepTransactions, BeamGroups, StepRecording):
    """FCFS iteration-level scheduler. Owns every Sequence; the manager owns the memory. A beam
    request's sequences are a group (``beam_groups.py``: scheduled, preempted, admitted as one);
    ``update`` records a step's samples (``recording.py``); the pool's size and how far it can
    grow are ``pool_reach.py``'s."""

    def __init__(self, manager: MemoryManager, config: SchedulerConfig = SchedulerConfig(),
                 tables: Optional[TableTracker] = None):
        """``tables``: fills each plan's table edits for a real cache (None: the simulator)."""
        self.manager, self.config, self.tables = manager, config, tables
        self.max_seq_len = config.sequence_limit_tokens(manager.max_seq_len)
        self.growable = False           # True: a MemoryBudget resizes it (use_budget)
        self.budget_share = None        # that budget's share: how far it can grow
        self._denied_room: Optional[Sequence] = None   # this step: a running chunk got no room
        self.starved = False    # the last step ran nothing (none admitted, none got room): grow
        self.max_fit_tokens = self.max_fit_bytes = 0
        self._init_reach()
        self._refresh_capacity()
        # tell the manager what is computed whenever a shareable unit may have filled
        self._publish_stride = manager.prefix_unit_tokens if config.enable_prefix_sharing else 0
        self.metrics = SchedulerMetrics()
        self.waiting: deque = deque()   # FCFS; preempted sequences go back to the front
        self.running: List[Sequence] = []  # in admission order
        self.swapped: deque = deque()
        self.seqs: Dict[int, Sequence] = {}   # submitted and not yet forgotten, by seq_id
        self._next_seq_id = self._admit_counter = self._step = 0
        # the last plan, for update(): decodes (one token, always sampling) and the rest
        self._decoded: List[Sequence] = []
        self._scheduled: List[Tuple[Sequence, int, bool]] = []
        self._finished_ids: List[int] = []
        self._unfinished_samples: Dict[int, int] = {}   # request_id -> sequences not finished
        self._savepoint: Optional[Savepoint] = None   # open transaction (begin), else None
        self._private_orders: set = set()   # admit orders of running beams swapped in (_grow)

    # ---- submission ----------------------------------------------------------------------
    def add_request(self, request: Request) -> List[int]:
        """Queue a request; returns the seq ids of its n samples (the first prefills the prompt,
        the rest are forked from it). Raises RequestTooLargeError when it could never fit."""
        check_length(self, request.prompt_len, request.max_tokens, f"request {request.request_id}: ",
                     whole=bool(request.beam_width))
        if request.beam_width:
            self._check_beam_group_fits(request)
        if request.adapter is not None:
            check_adapter_fits(request, self.manager, *adapter_pool_bytes(self))
        if request.request_id in self._unfinished_samples:
            raise DuplicateSequenceError(f"request {request.request_id} is already queued")
        ids = list(range(self._next_seq_id, self._next_seq_id + request.n))
        self._next_seq_id += request.n
        self._unfinished_samples[request.request_id] = request.n
        seq = Sequence(ids[0], request)
        seq.pending_forks = tuple(ids[1:])
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        return ids

    # ---- adapters: a running sequence pins its request's adapter (module docstring) -------
    def _pin(self, seq: Sequence) -> None:
        if seq.adapter_id is not None:
            self.manager.acquire_adapter(seq.request.adapter, seq.seq_id)

    def _unpin(self, seq: Sequence) -> None:
        if seq.adapter_id is not None:
            self.manager.release_adapter(seq.request.adapter)

    def _fits(self, seq: Sequence, ids, reserve: int, share=None,
              tokens: Optional[int] = None) -> bool:
        """Whether ``seq`` (its first ``tokens``; None: all) can be allocated now leaving
        ``reserve`` tokens free (its adapter acquired first; ``share``: ``_sibling_share``'s)."""
        req = seq.request   # (a user's policy without adapters need not take ``adapter``)
        options = dict(share or {}, **({} if req.adapter is None else {"adapter": req.adapter}),
                       **self._lookup(req))
        return self.manager.can_allocate(seq.length if tokens is None else tokens, ids,
                                         req.prefix_scope, reserve,
                                         final_tokens=req.max_total_len, **options)

    @staticmethod
    def _lookup(req) -> dict:
        """``lookup=False`` for a request that reads no prefix cache (passed only then, as
        ``adapter``: a user's policy need not take it)."""
        return {} if req.prefix_lookup else {"lookup": False}

    def _admit_tokens(self, seq: Sequence) -> int:
        """Tokens ``seq`` is allocated at admission: all of them, unless whole they could never
        fit (a recomputed sequence grown past that behind a window: its prompt, which
        submission checked whole; the rest grows chunk by chunk, ``_schedule_prefill``)."""
        if seq.length <= self.manager.max_sequence_tokens or self._window_costs is None:
            return seq.length
        return seq.request.prompt_len

    # ---- queries -------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._decoded or self._scheduled)

    def state_of(self, seq_id: int) -> SeqState:
        if seq_id in self.seqs:
            return self.seqs[seq_id].state
        raise UnknownSequenceError(f"unknown sequence id {seq_id}")

    # ---- ending a request early -------------------------------------------------------
    def abort_request(self, request_id: int, status: SeqState = SeqState.ABORTED) -> List[int]:
        """End a request's unended sequences (waiting, running, swapped) ``status`` (ABORTED or
        FAILED), releasing memory and swap space now (units others hit stay theirs: a hit only
        names computed units). Returns the seq ids ended (also in the next ``plan.finished``);
        UnknownRequestError (nothing changed) if none is unended. Mid-step, update skips them."""
        ended = end_request(self, request_id, status)
        self._drop_ended_from_step()
        return ended

    def gauges(self) -> Dict[str, float]:
        """vLLM-named live gauges and counters."""
        return gauges(self)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step. Must be followed by ``update`` before the next ``schedule``."""
        if self._decoded or self._scheduled:
            raise SchedulerError("schedule() called twice without update() in between")
        self._step += 1
        plan = StepPlan([], [], finished=self._finished_ids)
        self._finished_ids, self._denied_room = [], None
        budget = self._schedule_decodes(plan, self.config.max_tokens_per_step)
        if not plan.preempted:
            budget = self._swap_in(plan, budget)
        if not plan.preempted and not self.swapped:
            self._admit(plan, budget)
        # nothing runs, the head (a beam group) cannot be admitted: a growable pool asks for more
        self.starved = bool(self.waiting) and not (plan.seqs or self.running or self.swapped)
        if self.starved and not plan.preempted and self._cannot_grow():   # (admission was tried)
            self._never_fits(self.waiting[0], "cannot be admitted to an empty cache")
        self._unblock_groups(plan)
        if self._denied_room is not None and not (plan.seqs or plan.preempted):
            # a chunk of a running sequence got no room (in a pool a budget shrank below what
            # it holds) and nothing ran: nothing would change step after step; it must grow
            self.starved = True
            if self._cannot_grow():
                self._never_fits(self._denied_room, "gets no room to grow in a cache")
        plan.ops = self.manager.take_ops()
        if self.tables is not None:
            self.tables.fill(plan, self.manager)
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        # The hot path of every step (one pass over ``running``), inlined on purpose: a decode
        # appends one token to the manager and emits one ScheduledSeq. The general path
        # (_grow / _emit) handles preemption and prefill chunks. Iterating a list while
        # _grow pops from its tail is safe: the iterator stops at the new end.
        running, prefills = self.running, []
        append, out, decoded = self.manager.append, plan.seqs, self._decoded
        share = self.config.enable_prefix_sharing
        new_entry = tuple.__new__
        if self.manager.window_tokens:     # memory behind every window goes back first, for
            for seq in running:            # every decode before any append (a beam copies then)
                if seq.length - seq.num_computed == 1 and seq.output:
                    self.manager.release_behind_window(seq.seq_id, seq.num_computed)
        ctx, ready = 0, None
        for seq in running:
            c = seq.num_computed
            if seq.length - c != 1 or not seq.output:
                prefills.append(seq)
                continue
            if seq.beam_width:         # a beam waits for its group (beam_groups.py)
                ready = self._ready_groups() if ready is None else ready
                if not ready[seq.request.request_id]:
                    continue
            ids = (seq.output[-1],)
            if seq.held <= c:
                try:
                    append(seq.seq_id, 1, ids if share else None)
                    seq.held = c + 1
                except OutOfCapacityError:
                    if not self._grow(seq, 1, plan):
                        # it preempted itself (with its group): it was the last one running
                        while decoded and decoded[-1].state is not SeqState.RUNNING:
                            decoded.pop()
                            ctx -= out.pop().num_computed_tokens
                        break
            out.append(new_entry(ScheduledSeq, (seq.seq_id, c, 1, ids, True, (), seq.adapter_id)))
            decoded.append(seq)
            ctx += c
        n = len(out)
        plan.num_new_tokens += n
        plan.num_context_tokens += ctx + n
        budget -= n
        for seq in prefills:
            budget = self._schedule_prefill(plan, seq, budget, may_preempt=False)
        return budget

    def _schedule_prefill(self, plan: StepPlan, seq: Sequence, budget: int,
                          may_preempt: bool) -> int:
        # a recomputing beam stops before its last token: it samples with its group
        if seq.shared_from is not None and not self._adopt_shared(seq):
            return budget      # it starts once its leader has computed what they share
        last = 1 if seq.beam_width and seq.output else 0
        new = min(seq.length - last - seq.num_computed, budget)
        if new <= 0 or seq.state is not SeqState.RUNNING:
            return budget
        if self.manager.window_tokens:
            self.manager.release_behind_window(seq.seq_id, seq.num_computed)
        if not self._grow(seq, new, plan, may_preempt):
            # a recomputed sequence growing past its prompt behind a window: a chunk that
            # holds no more than a decode would at its end (fit_tokens counts those)
            short = self.window_step_end(seq) - seq.num_computed if self._window_costs is not None else new
            if short >= new or not self._grow(seq, short, plan, may_preempt):
                self._denied_room = seq
                return budget
            new = short
        self._emit(plan, seq, new)
        return budget - new

    def _grow(self, seq: Sequence, new: int, plan: StepPlan, may_preempt: bool = True) -> bool:
        """Make the manager hold room for ``new`` tokens after ``seq.num_computed``, preempting
        from the tail of ``running`` while it does not fit. False when ``seq`` got no room."""
        need = seq.num_computed + new - seq.held
        if need <= 0:
            return True
        ids = seq.new_token_ids(seq.held, seq.held + need) if self.config.enable_prefix_sharing else None
        while True:
            try:
                self.manager.append(seq.seq_id, need, ids)
                seq.held += need
                return True
            except OutOfCapacityError:
                if not may_preempt:
                    return False
                victims = self._tail_unit()
                # alone, it would come back the same way for ever (the cache cannot grow); not
                # a group swapped in (each beam its own copy): recomputed once, it shares again
                stuck = seq in victims and len(victims) == len(self.running) and self._cannot_grow()
                private = stuck and any(m.admit_order in self._private_orders for m in victims)
                self._preempt_unit(victims, plan, recompute=private)
                if seq in victims:
                    if stuck and not private:
                        self._never_fits(seq, "cannot grow in a cache")
                    return False

    def _emit(self, plan: StepPlan, seq: Sequence, new: int) -> None:
        c = seq.num_computed
        sample = c + new == seq.length
        plan.seqs.append(ScheduledSeq(seq.seq_id, c, new, seq.new_token_ids(c, c + new), sample,
                                      seq.pending_forks if sample else (), seq.adapter_id))
        plan.num_new_tokens += new
        plan.num_context_tokens += c + new
        self._scheduled.append((seq, new, sample))

    def _preempt(self, seq: Sequence, plan: StepPlan, swap: Optional[bool] = None) -> None:
        """Take the most recently admitted running sequence off the device (``swap``: decided
        for its beam group, else by the config and ``_swappable``)."""
        self.running.pop()
        self._unpin(seq)                  # swapped out or waiting: its adapter may go idle
        self.metrics.num_preemptions += 1
        plan.preempted.append(seq.seq_id)
        swap = self._swappable(seq) if swap is None else swap
        if swap and self._try_swap_out(seq):
            seq.state, seq.held = SeqState.SWAPPED, 0
            self.swapped.appendleft(seq)
            plan.swapped_out.append(seq.seq_id)
            self.metrics.num_swap_preemptions += 1
            return
        self._requeue(seq, seq.num_computed)

    def _requeue(self, seq: Sequence, computed_tokens: int) -> None:
        """Free ``seq`` (telling the manager ``computed_tokens``: what it may publish) and put it
        at the head of ``waiting``, to be recomputed."""
        self.manager.free(seq.seq_id, computed_tokens=computed_tokens)
        self.metrics.recomputed_tokens += seq.num_computed
        seq.num_computed = seq.held = 0
        seq.state, seq.shared_from = SeqState.WAITING, None
        self.waiting.appendleft(seq)

    def _swappable(self, seq: Sequence) -> bool:
        # a sequence part-way through its prefill is recomputed, not swapped: free tells the
        # manager how far it got, so only computed units are published
        uncomputed = self.config.enable_prefix_sharing and seq.held > seq.num_computed
        return self.config.preemption == "swap" and not uncomputed and seq.shared_from is None

    def _try_swap_out(self, seq: Sequence) -> bool:
        if not self.manager.can_swap_out(seq.seq_id):
            return False
        try:
            self.manager.swap_out(seq.seq_id)
        except SwapSpaceExhaustedError:
            return False
        return True

    def _swap_in(self, plan: StepPlan, budget: int) -> int:
        while self.swapped and len(self.running) < self.config.max_running and budget > 0:
            group = self._swapped_unit()
            ids, adapter = [m.seq_id for m in group], group[0].request.adapter
            kw = {} if adapter is None else {"adapter": adapter}
            fits = self.manager.can_swap_in_all(ids, **kw) and (      # None: not with its next
                not self.growable or self.manager.can_swap_in_all(ids, extra_tokens=1, **kw)
                or None)       # token (swapped out at once, step after step): wait for growth
            if len(self.running) + len(group) > self.config.max_running or not fits:
                if not self.running and fits is False:   # an empty cache: it never will (a
                    self._recompute_swapped(group)   # beam group shared memory it cannot now)
                    continue
                break
            for seq in group:
                self._pin(seq)                # the adapter first: loaded again if evicted
                self.manager.swap_in(seq.seq_id)
                self.swapped.popleft()
                seq.held = self.manager.num_tokens(seq.seq_id)
                self._run_beside(seq)
                budget = self._schedule_prefill(plan, seq, budget, may_preempt=False)
            if group[0].beam_width:   # each member its own copy of what they share (_grow)
                self._private_orders = {s.admit_order for s in self.running} & (
                    self._private_orders | {m.admit_order for m in group})
        return budget

    def _admit(self, plan: StepPlan, budget: int) -> None:
        mgr, cfg = self.manager, self.config
        while self.waiting and budget > 0 and len(self.running) < cfg.max_running:
            seq = self.waiting[0]
            req = seq.request
            ids = seq.token_ids() if cfg.enable_prefix_sharing else None
            reserve = self.watermark_tokens if self.running else 0   # never block an idle cache
            if seq.beam_width:
                group = self._admit_group(seq, reserve)
                if group is None:
                    break
                for member in group:
                    budget = self._schedule_prefill(plan, member, budget, may_preempt=False)
                continue
            share = self._sibling_share(seq) if ids is None else {}
            tokens = self._admit_tokens(seq)
            ids = ids if ids is None else ids[:tokens]
            if not self._fits(seq, ids, reserve, share, tokens):
                break
            self._pin(seq)             # both or neither: the adapter, then the sequence
            try:
                hit = mgr.allocate(seq.seq_id, tokens, ids, req.prefix_scope,
                                   final_tokens=req.max_total_len, **share, **self._lookup(req))
                check_hit(mgr, hit, tokens, ids, req.prefix_lookup, **share)
            except OutOfCapacityError:
                if seq.adapter_id is None:
                    raise
                self._unpin(seq)       # (its prefix hits went to load the adapter)
                break
            except ManagerContractError:   # a user's policy: undone, then refused by name
                mgr.free(seq.seq_id, computed_tokens=0)
                self._unpin(seq)
                raise
            self.waiting.popleft()
            seq.held, seq.num_computed = tokens, min(hit, seq.length - 1)   # the last is computed
            self._make_running(seq)
            # a hit names only units whose K/V are written (managers publish on compute, told
            # by update), so the sequence reads them at once
            budget = self._schedule_prefill(plan, seq, budget, may_preempt=False)

    def _make_running(self, seq: Sequence) -> None:
        seq.state, seq.admit_order = SeqState.RUNNING, self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)
