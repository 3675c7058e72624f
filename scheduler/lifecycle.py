"""What happens when a step or a request does not complete: the scheduler's side of a step
transaction (an explicit copy of what ``schedule()`` and ``update()`` change) and ending a
request early. ``runtime/transaction.py``'s StepTransaction composes it with the manager's
transaction, the tracker and the executor; a rolled-back plan is forgotten.

Each field is copied by name, with the copy its type needs (queues by their members, each
sequence by ``Sequence.save``); nothing is inferred from a value's shape, so a field added to
``Scheduler`` or ``Sequence`` that ``schedule()`` changes must be added here (the rollback tests
compare every field of both).
"""
from __future__ import annotations

from collections import deque
from typing import List

from .adapters import adapter_pool_bytes, check_adapter_fits
from .errors import (CacheResizeError, CacheShrunkError, ConfigError, RequestTooLargeError,
                     SchedulerError, UnknownRequestError, length_field)
from .plan import StepPlan
from .request import Sequence, SeqState


class Savepoint:
    """What ``Scheduler.schedule()``, ``update()``, ``finish``, ``forget`` or ``abort_request``
    may change, as it was at ``Scheduler.begin()``. Latency samples only grow: their lengths
    are kept."""

    __slots__ = ("waiting", "running", "swapped", "sequences", "seqs", "finished_ids",
                 "unfinished", "step", "admit_counter", "metrics", "latency_ends", "capacity",
                 "starved", "private_orders")

    def __init__(self, scheduler) -> None:
        s, m = scheduler, scheduler.metrics
        self.waiting, self.running, self.swapped = list(s.waiting), list(s.running), list(s.swapped)
        self.sequences = [(seq, seq.save()) for queue in (s.waiting, s.running, s.swapped)
                          for seq in queue]
        self.seqs = dict(s.seqs)     # update adds forked children, forget drops ended ones
        self.finished_ids = list(s._finished_ids)
        self.unfinished = dict(s._unfinished_samples)
        self.step, self.admit_counter = s._step, s._admit_counter
        self.metrics = (m.num_preemptions, m.num_swap_preemptions, m.recomputed_tokens,
                        m.num_aborted_requests, m.num_failed_requests, m.num_finished_requests,
                        m.generated_tokens)
        self.latency_ends = (m.ttft_s.end, m.itl_s.end)
        self.capacity = (s.total_tokens, s.max_fit_tokens, s.max_fit_bytes,   # resize
                         s.watermark_tokens)
        self.starved = s.starved
        self.private_orders = set(s._private_orders)   # beam groups swapped in (their own copies)

    def restore(self, scheduler) -> None:
        """Put ``scheduler`` back exactly as it was when this savepoint was taken."""
        s, m = scheduler, scheduler.metrics
        s.waiting, s.running, s.swapped = deque(self.waiting), list(self.running), deque(self.swapped)
        for seq, saved in self.sequences:
            seq.restore(saved)
        s.seqs.clear()
        s.seqs.update(self.seqs)
        s._finished_ids = list(self.finished_ids)
        s._unfinished_samples = dict(self.unfinished)
        s._step, s._admit_counter = self.step, self.admit_counter
        (m.num_preemptions, m.num_swap_preemptions, m.recomputed_tokens,
         m.num_aborted_requests, m.num_failed_requests, m.num_finished_requests,
         m.generated_tokens) = self.metrics
        m.ttft_s.truncate(self.latency_ends[0])
        m.itl_s.truncate(self.latency_ends[1])
        s.total_tokens, s.max_fit_tokens, s.max_fit_bytes, s.watermark_tokens = self.capacity
        s.starved = self.starved
        s._private_orders = set(self.private_orders)
        s._decoded, s._scheduled = [], []


def end_request(scheduler, request_id: int, status: SeqState) -> List[int]:
    """``Scheduler.abort_request``: end a request's unended sequences with ``status``."""
    s = scheduler
    if status not in (SeqState.ABORTED, SeqState.FAILED):
        raise SchedulerError(f"abort_request status must be ABORTED or FAILED, got {status}")
    if request_id not in s._unfinished_samples:
        raise UnknownRequestError(f"request {request_id} has no unfinished sequence "
                                  f"(never submitted, or already ended)")
    seqs = [q for q in s.seqs.values() if q.request.request_id == request_id and not q.state.is_ended]
    for seq in seqs:
        _release(s, seq, status)
    del s._unfinished_samples[request_id]
    if status is SeqState.ABORTED:
        s.metrics.num_aborted_requests += 1
    else:
        s.metrics.num_failed_requests += 1
    return [q.seq_id for q in seqs]


def check_length(scheduler, prompt_tokens: int, max_tokens: int, who: str = "",
                 whole: bool = False) -> None:
    """RequestTooLargeError when ``prompt_tokens + max_tokens`` could never fit one sequence
    alone (``fit_tokens``: behind a window, what each layer kind holds; ``whole``: the whole
    length in every layer, as a beam group's is counted), or on a MemoryBudget does not fit
    what the pool can grow to while the other shares keep their minimums (its reach, which it
    grows to on demand); CacheShrunkError when it fits only once the pool is resized back up.
    ``who`` starts the message ("request 7: ")."""
    s, final = scheduler, prompt_tokens + max_tokens
    asks = f"{who}{prompt_tokens} prompt + {max_tokens} new tokens = {final} tokens"
    if s.max_seq_len is not None and final > s.max_seq_len:
        raise RequestTooLargeError(f"{asks} exceed the {s.max_seq_len} tokens one sequence may "
                                   f"hold (max_seq_len {s.max_seq_len})", None,
                                   length_field(prompt_tokens, s.max_seq_len))
    fit, most = s.fit_tokens(prompt_tokens, whole)
    if final <= fit:
        return
    after = f" after a {prompt_tokens}-token prompt" if most > s.max_fit_tokens_at_max else ""
    if final <= most:       # (at its current size "after" only where the window helps there)
        now_after = after if fit > s.max_fit_tokens else ""
        raise CacheShrunkError(
            f"{asks} do not fit the cache at its current size ({s.manager.cache_bytes} bytes, "
            f"{fit} tokens of one sequence at most{now_after}); resized back up it holds "
            f"{most}{after}", None, length_field(prompt_tokens, fit))
    full, ever = s.ever_fit_tokens(prompt_tokens, whole)
    if final <= ever:       # on a MemoryBudget, past what the others' minimums leave it
        raise RequestTooLargeError(
            f"{asks} do not fit the {most} tokens of one sequence{after} its cache holds "
            f"{s.reach_note(ever)}", None,
            length_field(prompt_tokens, most))
    after = f" after a {prompt_tokens}-token prompt" if ever > full else ""
    raise RequestTooLargeError(f"{asks} can never fit; the cache holds "
                               f"{ever} tokens of one sequence at most{after}", None,
                               length_field(prompt_tokens, ever))


def withdraw_request(scheduler, request_id: int) -> None:
    """Take back a request ``add_request`` queued that no step has seen (a batch refused part
    way: its earlier prompts), as if it had never been added: no counter moves, nothing is
    reported ended (an ended request of the same id, not yet forgotten, stays)."""
    s = scheduler
    seqs = [q for q in s.seqs.values()
            if q.request.request_id == request_id and not q.state.is_ended]
    if not seqs or any(q.state is not SeqState.WAITING or q not in s.waiting for q in seqs):
        raise SchedulerError(f"request {request_id} cannot be withdrawn: only a request no "
                             f"step has scheduled can")
    for seq in seqs:
        s.waiting.remove(seq)
        del s.seqs[seq.seq_id]
    del s._unfinished_samples[request_id]


def resize_pool(scheduler, cache_bytes: int, preempt: bool, check_fit: bool, partial: bool):
    """``Scheduler.resize``: the manager's pool set to ``cache_bytes``, preempting from the
    tail of ``running`` (swap or recompute, as a step would) while running sequences hold what
    must go and ``preempt`` allows it; ``partial``: what could not be freed stays (no error).
    ``check_fit``: CacheResizeError when a live request would no longer fit: a sequence's
    longest, a beam group as it would come back now and by ``add_request``'s rule
    (``beam_fit.check_beam_group_fits``: at the lengths it surely reaches), an adapter beside
    its request. Returns the plan (ops, preemptions, table edits)."""
    s = scheduler
    plan = StepPlan([], [], finished=[])
    try:
        short = s.manager.resize(cache_bytes)
    except ConfigError as error:
        raise CacheResizeError(str(error)) from None
    while short and preempt and s.running:
        s._preempt_unit(s._tail_unit(), plan)
        short = s.manager.resize(cache_bytes)
    if short and not partial:
        held = "" if preempt else "; pass preempt=True to preempt them"
        raise CacheResizeError(
            f"resizing the cache to {cache_bytes} bytes: {short} bytes are held by "
            f"{len(s.running)} running sequence(s) and could not be freed{held}")
    check_fit = check_fit and not partial    # (a budget's partial shrink: see growable)
    if check_fit or cache_bytes:   # asleep (0 bytes, unchecked): requests added meanwhile
        s._refresh_capacity()      # are checked against the pool they will wake to
    if check_fit:
        live = [q for q in s.seqs.values() if not q.state.is_ended]
        for q in sorted(live, key=lambda q: -q.request.max_total_len):   # the longest first
            req = q.request
            fit = s.max_fit_tokens if req.beam_width else s.fit_tokens(req.prompt_len)[0]
            if req.max_total_len > fit:
                raise CacheResizeError(
                    f"resizing the cache to {cache_bytes} bytes: request {req.request_id} "
                    f"needs {req.max_total_len} tokens, the cache would hold {fit} tokens of "
                    f"one sequence")
        groups: dict = {}           # a beam group as it would come back (beam_groups.py)
        for q in live:
            if q.beam_width:
                groups.setdefault(q.request.request_id, []).append(q)
        for rid, members in groups.items():
            need = s.group_floor_tokens(members)
            if need > s.total_tokens:
                raise CacheResizeError(
                    f"resizing the cache to {cache_bytes} bytes: beam search request {rid} "
                    f"({len(members)} beams of {members[0].length} tokens) needs {need} tokens "
                    f"to come back, the cache would hold {s.total_tokens}")
            try:                    # and add_request's rule: at the lengths it surely reaches
                s._check_beam_group_fits(members[0].request)
            except RequestTooLargeError as error:
                raise CacheResizeError(f"resizing the cache to {cache_bytes} bytes: "
                                       f"{error}") from None
        for q in live:              # and beside its adapter (the pages it takes from KV)
            if q.request.adapter is not None:
                try:
                    check_adapter_fits(q.request, s.manager, *adapter_pool_bytes(s))
                except RequestTooLargeError as error:
                    raise CacheResizeError(f"resizing the cache to {cache_bytes} bytes: "
                                           f"{error}") from None
    plan.ops = s.manager.take_ops()
    if s.tables is not None:
        s.tables.fill(plan, s.manager)
    return plan


def _release(s, seq: Sequence, status: SeqState) -> None:
    if seq.state is SeqState.RUNNING:
        s.manager.free(seq.seq_id, computed_tokens=seq.num_computed)
        s._unpin(seq)                       # its adapter's use
        s.running.remove(seq)
    elif seq.state is SeqState.SWAPPED:
        s.manager.free(seq.seq_id)          # drops its host copy
        s.swapped.remove(seq)
    else:
        s.waiting.remove(seq)
    seq.state, seq.held = status, 0
    s._finished_ids.append(seq.seq_id)


class StepTransactions:
    """The Scheduler's step transaction (a mixin over its fields; ``_savepoint`` starts None)."""

    def begin(self) -> None:
        """Open a transaction over the scheduler's own state (queues, sequence states,
        counters): ``rollback`` puts all of it back as it is now, ``commit`` keeps the changes.
        The manager has its own ``begin``; a step opens both. Costs one copy of the queues."""
        if self._savepoint is not None:
            raise SchedulerError("begin() inside an open transaction; commit or roll back first")
        self._savepoint = Savepoint(self)

    @property
    def in_transaction(self) -> bool:
        """Whether ``begin`` was called without a ``commit``/``rollback`` since."""
        return self._savepoint is not None

    def commit(self) -> None:
        """Keep every change since ``begin``."""
        self._close_transaction()

    def rollback(self) -> None:
        """Undo every change since ``begin`` (a plan scheduled since then is forgotten: the
        next ``schedule()`` plans afresh). The tracker is not touched: whoever knows whether
        the plan reached its executor resends it (StepTransaction)."""
        self._close_transaction().restore(self)

    def _close_transaction(self) -> Savepoint:
        savepoint, self._savepoint = self._savepoint, None
        if savepoint is None:
            raise SchedulerError("commit() or rollback() without begin()")
        return savepoint

    def discard_step(self) -> None:
        """Forget the last plan without recording progress (its tokens were not computed): the
        memory it planned stays held and the next ``schedule()`` computes those tokens again."""
        self._scheduled, self._decoded = [], []
