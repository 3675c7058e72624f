"""The engine's failure contract: a step is recorded whole or not at all, and a request whose
work keeps failing ends "failed" instead of blocking the engine.

A step is one StepTransaction (runtime/transaction.py) over scheduler, manager and executor in
two phases (``Engine.step``):

    begin -> plan = schedule() -> execute (ops, model) -> sample -> executed   (the plan ran)
          -> update + emit (tokens reach the scheduler AND the outputs)   -> commit (recorded)

An exception anywhere before the commit (KeyboardInterrupt, SystemExit and bookkeeping errors
included) leaves no token recorded: the memory the plan applied is kept (tables and memory
agree), everything else the step did is undone (scheduler, manager, outputs, texts, sample
generators) and the next step computes the same tokens again. Past the commit the step is
recorded; only the ``on_token`` callbacks run after it.

Whom a failed step is blamed on:
- a memory plan failed: the cache names the op that failed (``PlanExecutionError.op_index``)
  and the op names the sequence it was planned for, ``op.owner``, set by the manager that
  emitted it (scheduler/managers/base.py); nothing is read back from the manager:

    SwapOut / SwapIn              -> op.seq_id (their owner)
    MapExtent / CopyExtent        -> the sequence on op.slot / op.dst_slot when planned (vmem)
    CopyBlock                     -> the writer that moved to dst_block (paged)
    UnmapExtent, a fault with     -> nobody (owner None): reclaiming serves whoever maps next;
    no op index                      bounded retries, then the error reaches the caller

  After ``max_plan_retries + 1`` failed steps in a row blamed on one request, the engine ends
  it "failed" and goes on.
- the model's forward, the sampler or a beam selection raised (an ``Exception``): the step's
  work is run again one sequence at a time (its forward alone, its row of the logits sampled
  alone, a beam group's selection alone: beam requests are candidates as samples are). The
  requests whose work fails alone, ``max_plan_retries + 1`` times in a row, end "failed"; the
  others' tokens are computed again by the next step, exactly as if the failed request had
  never been there: 8-bit scales that the failed step's writes or a lone run fixed are
  unfixed again (``ScaleTable.unfix_unsettled``), so the next kept write fixes them from the
  requests that go on, not from the failed one. With tensor parallelism the lone forwards
  run on every rank (a plan of one sequence, broadcast as any plan): of a forward's
  failures only NonFiniteKVError, which the ranks agree on, gets here; any other is
  TensorParallelError, which closes the engine. Unattributable (nothing fails alone, or every
  request fails alone): the exception reaches the caller with every request intact, as any
  exception does (``failed_step_request_ids``: the requests the step ran, a server's to end).
- planning found a request can never run: its head cannot be admitted even to an empty cache,
  or it cannot grow with the cache to itself (a beam group preempted out of shared memory
  that must come back into private memory, each beam its own copy; RequestTooLargeError), or
  recording the step found the tokenizer cannot decode its tokens (detokenize.TokenDecodeError):
  that request ends "failed" at once, its error naming it; the others go on.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from functools import partial
from typing import Dict, Iterable, List, Optional, Set, Tuple

from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.runtime.interrupts import deferred_interrupts
from vmemkv.runtime.transaction import Phase
from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.plan import StepPlan
from vmemkv.scheduler.request import SeqState

from .call_checks import check_request_id
from .detokenize import TokenDecodeError
from .ending import ending_plan
from .errors import (EngineBusyError, EngineClosedError, RequestEndedError, RequestRejectedError,
                     TensorParallelError, UnknownRequestError)
from .outputs import RequestError, RequestOutput, TokenEvent
from .sampler import restore_generators


def culprit_seq_ids(ops: list, op_index: Optional[int]) -> Set[int]:
    """The seq id the failed op ``ops[op_index]`` was planned for: its ``owner``, set by the
    manager that emitted it (empty for a reclaiming op, or no op named). Reads only the plan."""
    if op_index is None or not 0 <= op_index < len(ops):
        return set()
    owner = ops[op_index].owner
    return set() if owner is None else {owner}


class RecordingSavepoint:
    """What recording a step changes on the engine's side, as it was before: the records of
    the samples that drew (outputs, texts, their requests' counts and status), which samples
    and prompt-logprob collectors are live, and the step counters. ``restore`` is idempotent
    (a StepTransaction may run it twice)."""

    def __init__(self, engine, seq_ids: Iterable[int]) -> None:
        self.engine = engine
        self.samples = {s: engine._samples[s] for s in seq_ids if s in engine._samples}
        self.beams = engine._beams.save(engine._requests)   # beams are not samples
        self.records = [(record, record.save()) for record in self.samples.values()]
        self.prompt_logprobs = dict(engine._prompt_logprobs)
        self.strikes = dict(engine._strikes)
        self.counters = (engine._computed_tokens, engine._prompt_tokens, engine._steps,
                         engine._kv_usage.end)

    def restore(self) -> None:
        engine = self.engine
        for record, saved in self.records:
            record.restore(saved)
        engine._samples.update(self.samples)
        engine._beams.restore(self.beams)
        for live, saved in ((engine._prompt_logprobs, self.prompt_logprobs),   # shared with the
                            (engine._strikes, self.strikes)):                  # runner: in place
            live.clear()
            live.update(saved)
        engine._computed_tokens, engine._prompt_tokens, engine._steps, kv_usage = \
            self.counters
        engine._kv_usage.truncate(kv_usage)


class RequestLifecycle:
    """The Engine's failure contract and early ends (a mixin over Engine's fields: scheduler,
    cache, runner, config, _requests, _samples, _beams, _strikes; the step's ``_txn``, ``_draws``
    and ``_beam_rows``): recording or undoing a step, failing a request, abort, status, output."""
    failed_step_request_ids: Tuple[int, ...] = ()   # what the last step that raised planned

    def _record_step(self, plan, sampled: Dict[int, int]) -> List[TokenEvent]:
        """The plan ran: its memory is kept (``executed``); then its tokens are recorded
        (``Engine._record``: scheduler update, outputs, counters) and committed together, or,
        if anything raises first, not at all (``_step_failed``)."""
        self._txn.executed(RecordingSavepoint(self, sampled).restore)
        events = self._record(plan, sampled)
        self._txn.commit()
        self._settle_scales(keep=True)
        return events

    def _settle_scales(self, keep: bool) -> None:
        """8-bit scales fixed by first writes since the last committed step: kept with the
        step's commit (``keep``), else unfixed (the next kept write fixes them). With tensor
        parallelism each rank's cache holds its own table: rank 0 settles its own (the others
        at the next forward) or has every rank unfix theirs (one broadcast, when a forward ran
        since the last keep or drop: ``TensorParallel.settle_scales``)."""
        scales = self.kv.cache.kv_scales
        if scales is None:
            return
        if self.tp is not None:   # kept or unfixed on rank 0, the followers told (launch.py)
            try:
                self.tp.settle_scales(keep)
            except TensorParallelError as error:
                self.abandon(error)   # a rank died or hung: every rank's memory and process go
                raise
        elif keep:
            scales.settle()
        else:
            scales.unfix_unsettled()

    def _plan_failed(self, plan, error: PlanExecutionError) -> bool:
        """Roll the step back; True when the failure ended a request (the step then returns)."""
        restore_generators(self._draws)
        culprits = culprit_seq_ids(plan.ops, error.op_index)
        self._txn.rollback()
        self._settle_scales(keep=False)
        self.plan_failures += 1
        if not error.rolled_back:
            return False
        doomed = []
        for rid in {self._request_id_of(s) for s in culprits} - {None}:
            self._strikes[rid] = self._strikes.get(rid, 0) + 1
            if self._strikes[rid] > self.config.max_plan_retries:
                doomed.append(rid)
        for rid in sorted(doomed):
            del self._strikes[rid]
            self._end_request(rid, SeqState.FAILED, error)
        return bool(doomed)

    def _refuse_step_inside_step(self) -> None:
        """``step()`` called from within a step (the model, the sampler, a memory op) is
        EngineBusyError, before its ``begin()`` could roll back the step under way (leaving a
        vmem cache broken for good). Read from the call stack, not a flag: an interrupt between
        a step's end and a flag's reset left it set, and every later step was refused."""
        step_code = type(self)._step.__code__
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is step_code and frame.f_locals.get("self") is self:
                raise EngineBusyError("step() inside a step under way (from an on_token callback, "
                                      "the model or a memory op): a step is not re-entrant; "
                                      "return and let the caller's loop step (a callback may "
                                      "call add_request, abort or close)")
            frame = frame.f_back

    def _step_failed(self, plan, logits, drawing, error: BaseException) -> bool:
        """Something raised (an interrupt included) in ``step``: finish or undo what the step
        did, by the transaction's phase. Planning: undo its draws, keep its applied memory (or
        roll it back) and forget its progress; executed: undo the recording too; recorded:
        finish the commit. True when the failure was blamed on requests that were then failed
        (the step returns); False: the caller re-raises."""
        self.failed_step_request_ids = () if plan is None else tuple(sorted(   # a server ends
            {self._request_id_of(s.seq_id) for s in plan.seqs} - {None}))     # only these
        phase = self._txn.phase
        if phase in (Phase.IDLE, Phase.RECORDED):   # before begin, or the step is recorded
            self._txn.rollback()                     # (RECORDED: completes the commit)
            self._settle_scales(keep=phase is Phase.RECORDED)
            return False
        restore_generators(self._draws)
        self._settle_scales(keep=False)   # the lone runs below fix none from the failed batch
        if phase is Phase.EXECUTED:   # the recording raised: undone, the plan's memory kept
            self._txn.rollback()
        kept = phase is Phase.PLANNING and self._keep_applied_memory()
        never_fits = isinstance(error, RequestTooLargeError) and error.request_id is not None
        if (plan is None and never_fits) or isinstance(error, TokenDecodeError):
            # a request at fault by itself (module docstring): it alone ends "failed"
            self._end_request(error.request_id, SeqState.FAILED, error)
            return True
        if plan is None or not kept or not isinstance(error, Exception):
            return False
        if logits is None:   # the forward raised: run each sequence's part alone
            units = {s.seq_id: partial(self._execute, StepPlan([s], [])) for s in plan.seqs}
        elif drawing is not None:   # the sampler or a beam selection raised: each row alone,
            units = {seq_id: partial(self.sampler.sample, logits, [sample])   # each beam
                     for seq_id, sample in drawing.items()}                   # group alone
            units.update(self._beam_selections(logits))
        else:
            return False
        return self._fail_culprits(units)

    def _beam_selections(self, logits) -> dict:
        """{a beam's seq id: its group's selection of this step, run alone}, one per group."""
        rows: Dict[int, Dict[int, int]] = {}
        for seq_id, row in self._beam_rows.items():
            rows.setdefault(self._beams.group_of[seq_id], {})[seq_id] = row
        return {next(iter(group)): partial(self._beams.select, logits, group)
                for group in rows.values()}

    def _fail_culprits(self, units: dict) -> bool:
        """``units``: {seq_id: its part of the failed step, to run alone}. Requests whose part
        fails alone ``max_plan_retries + 1`` times in a row end "failed"; True if any did.
        Nobody is blamed when no request's part fails alone, or every request's does (the
        fault is then the engine's, not a request's), unless a part was refused for its own
        parameters (a RequestRejectedError, e.g. every processed score -inf): that request is
        at fault wherever it runs, alone in its step too."""
        request_of = {seq_id: self._request_id_of(seq_id) for seq_id in units}
        failing = {seq_id: error for seq_id, work in units.items()
                   if (error := self._fails_alone(work)) is not None}
        culprits = {request_of[seq_id] for seq_id in failing}
        if culprits and culprits == set(request_of.values()):
            failing = {seq_id: error for seq_id, error in failing.items()
                       if isinstance(error, RequestRejectedError)}
        if not failing:
            return False
        doomed: Dict[int, BaseException] = {}
        for seq_id, error in failing.items():
            retries = (self._fails_alone(units[seq_id])
                       for _ in range(self.config.max_plan_retries))
            if all(again is not None for again in retries):
                doomed.setdefault(request_of[seq_id], error)
        for rid in sorted(doomed):
            self._end_request(rid, SeqState.FAILED, doomed[rid])
        return bool(doomed)

    def _fails_alone(self, work) -> Optional[Exception]:
        """What ``work()`` (one sequence's forward, one row's sampling, one beam group's
        selection, with its memory in place) raises, or None; sample generators and 8-bit
        scales are left as before the step (no lone run depends on the order of the others)."""
        try:
            work()
        except TensorParallelError as error:
            self.abandon(error)   # a rank died, hung or left the forward: not the request's fault
            raise
        except Exception as error:   # noqa: BLE001 -- the probe's answer
            return error
        finally:
            restore_generators(self._draws)
            self._settle_scales(keep=False)
        return None

    def _request_id_of(self, seq_id: int) -> Optional[int]:
        """The request a live sample or beam belongs to (None: neither)."""
        record = self._samples.get(seq_id)
        if record is not None:
            return record.request.output.request_id
        return self._beams.group_of.get(seq_id)

    def _keep_applied_memory(self) -> bool:
        """The model or the sampler raised: keep the plan's memory ops if applied (tables and
        memory agree) and drop the step's progress (True); if not (or undone), roll it back."""
        try:
            if self.runner.ops_applied:
                self.kv.cache.wait_for_plan()
        except PlanExecutionError:
            self.runner.ops_applied = False
        if not self.runner.ops_applied:
            self._txn.rollback()
            return False
        self._txn.forget_step()
        if self._txn.tables is not None:   # the edits may not have reached the replica (an
            self._txn.tables.resend()      # interrupt in apply_tables): the next plan's are full
        return True

    # ---- ending requests early -----------------------------------------------------------
    def abort(self, request_id: int) -> RequestOutput:
        """End a request that has not ended, wherever it is (waiting, running, preempted,
        swapped): its memory, blocks and swap space are released now; its output keeps its
        tokens, status "aborted" (unfinished samples finish_reason "abort"). UnknownRequestError
        for an id never submitted or popped, RequestEndedError for one ended (nothing changes).
        Call it between steps (an ``on_token`` callback is), from the thread driving the
        engine: another thread's call while one runs is EngineBusyError."""
        state = self._request(request_id)
        if self._closed:   # close() ended every request "aborted": this is the truer refusal
            raise EngineClosedError(f"abort({request_id}) after close(): this engine's cache "
                                    f"is released")
        if not state.remaining:
            raise RequestEndedError(f"request {request_id} has already ended "
                                    f"({state.output.status}); there is nothing to abort")
        self._end_request(request_id, SeqState.ABORTED)
        return state.output

    def status(self, request_id: int) -> str:
        """"waiting", "running" or "swapped" (the furthest along of its samples) while a request
        is live; then "finished", "aborted" or "failed". UnknownRequestError for an unknown id."""
        state = self._request(request_id)
        if not state.remaining:
            return state.output.status
        ids = state.seq_ids + tuple(self._beams.live_seq_ids(request_id))
        live = {self.scheduler.state_of(s) for s in ids
                if (s in self._samples or s in self._beams.group_of) and s in self.scheduler.seqs}
        for seq_state in (SeqState.RUNNING, SeqState.SWAPPED):
            if seq_state in live:
                return seq_state.value
        return SeqState.WAITING.value

    def output(self, request_id: int, pop: bool = False) -> RequestOutput:
        """The (possibly partial) output of a request (a live one's: a snapshot, its lists
        copies); ``pop`` forgets an ended one (a change: one thread at a time, as the GUARDED
        calls). UnknownRequestError for an unknown id, EngineConfigError for a non-int id."""
        with self._guarded("output") if pop else nullcontext():
            state = self._request(request_id)
            if pop and not state.remaining:
                del self._requests[request_id]
            return state.output_for_caller()

    def _request(self, request_id: int) -> RequestState:
        """The state of request ``request_id``: EngineConfigError for an id that is no int
        (``check_request_id``: nothing is read), UnknownRequestError for an unknown one."""
        check_request_id(request_id)
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}: never returned by "
                                      f"add_request, or its output was already popped")
        return state

    def _end_request(self, request_id: int, status: SeqState,
                     error: Optional[BaseException] = None) -> None:
        """End a live request ``status`` (ABORTED or FAILED) in one transaction: the scheduler
        releases its sequences, what that frees (swap buffers too) leaves the manager as a plan
        run as a step's is (on every rank); a rank that dies or hangs closes the engine."""
        try:   # a Ctrl-C lands after the records agree with the plan run
            with deferred_interrupts():
                plan, _ = self._txn.run(lambda: ending_plan(self.scheduler, self.kv,
                                                            request_id, status))
                for seq_id in plan.finished:
                    self.scheduler.forget(seq_id)
                self._mark_ended(request_id, status, error)
        except TensorParallelError as tp_error:
            self.abandon(tp_error)   # run() rolled back: abandon's rollback finds nothing
            raise

    def _mark_ended(self, request_id: int, status: SeqState, error: BaseException | None) -> None:
        """Request ``request_id``'s records end ``status``; its memory is the caller's to free."""
        state = self._requests[request_id]
        reason = "abort" if status is SeqState.ABORTED else "error"
        for seq_id in state.seq_ids:
            if seq_id in self._samples:
                self._end_sample(seq_id, reason)
        self._end_beams(request_id, reason)
        state.remaining = 0
        state.output.status = status.value
        if error is not None:
            field = error.field if isinstance(error, RequestRejectedError) else None
            state.output.error = RequestError(type(error).__name__, str(error), field)

    def _end_sample(self, seq_id: int, reason: str) -> None:
        sample = self._samples.pop(seq_id)
        sample.end(reason)
        sample.request.remaining -= 1
        self._prompt_logprobs.pop(seq_id, None)

    def abandon(self, error: TensorParallelError) -> None:
        """A tensor-parallel rank died or hung (``error``): the open step is rolled back, every
        live request ends "failed" with ``error`` (not "aborted": nobody asked) and the engine
        closes (every rank's memory and process go)."""
        try:
            self._txn.rollback()
        finally:
            try:
                if not self._closed:
                    self._end_live_requests(error)
            finally:
                self.close()

    def _end_live_requests(self, error: Optional[TensorParallelError] = None) -> None:
        """Every live request ends, output kept: "failed" with ``error`` (``abandon``), or "aborted"
        (``close()``: their batch calls raise EngineClosedError). No plan runs (the cache is freed
        whole next, even when a tensor-parallel rank is dead); closed streams' requests drop."""
        status = SeqState.ABORTED if error is None else SeqState.FAILED
        for rid, state in self._requests.items():
            if state.remaining:
                self._mark_ended(rid, status, error)
                if error is None:
                    self._ended_by_close.add(rid)
        self._drop_forgotten()     # all ended above: dropped only (submission.py)
