"""Which request a failed step belongs to, so that one request's persistent fault ends that
request instead of blocking the engine.

A step is a transaction over scheduler + manager + cache (``Engine.step``). When its plan fails,
the cache names the op that failed (``PlanExecutionError.op_index``) and the op names the
sequence it was planned for, ``op.owner``, set by the manager that emitted it
(scheduler/managers/base.py); nothing is read back from the manager:

    SwapOut / SwapIn              -> op.seq_id (their owner)
    MapGroup / CopyGroup          -> the sequence on op.slot / op.dst_slot when planned (vmem)
    ResizeGroup                   -> the sequence whose group it backs (byte-mapped vmem)
    CopyBlock                     -> the writer that moved to dst_block (paged)
    UnmapGroup, ReleaseGroup,     -> nobody (owner None): reclaiming serves whoever maps next;
    shrinking an unheld group,       bounded retries, then the error reaches the caller
    no op index

After ``max_plan_retries + 1`` failed steps in a row blamed on one request, the engine ends it
"failed" and goes on.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Set

from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.scheduler.plan import StepPlan
from vmemkv.scheduler.request import SeqState

from .errors import RequestEndedError, TensorParallelError, UnknownRequestError
from .outputs import RequestError, RequestOutput


def culprit_seq_ids(ops: list, op_index: Optional[int]) -> Set[int]:
    """The seq id the failed op ``ops[op_index]`` was planned for: its ``owner``, set by the
    manager that emitted it (empty for a reclaiming op, or when no op is named). Reads nothing
    but the plan."""
    if op_index is None or not 0 <= op_index < len(ops):
        return set()
    owner = ops[op_index].owner
    return set() if owner is None else {owner}


class RequestLifecycle:
    """The Engine's failure contract and early ends (a mixin over Engine's fields: scheduler,
    cache, runner, config, _requests, _samples, _strikes): rolling a step back, blaming and
    failing a request, ``abort`` and ``status``."""

    def _begin(self) -> None:
        self.scheduler.begin()
        self.kv.manager.begin()

    def _commit(self) -> None:
        self.kv.manager.commit()
        self.scheduler.commit()

    def _rollback(self) -> None:
        self.kv.manager.rollback()
        self.scheduler.rollback()

    def _schedule(self):
        """Open the step's transaction and plan it; a scheduler error rolls both back."""
        self._begin()
        try:
            return self.scheduler.schedule()
        except BaseException:
            self._rollback()
            raise

    def _plan_failed(self, plan, error: PlanExecutionError) -> bool:
        """Roll the step back; True when the failure ended a request (the step then returns)."""
        culprits = culprit_seq_ids(plan.ops, error.op_index)
        self._rollback()
        self.plan_failures += 1
        if not error.rolled_back:
            return False
        doomed = []
        for rid in {self._samples[s].request.output.request_id for s in culprits if s in self._samples}:
            self._strikes[rid] = self._strikes.get(rid, 0) + 1
            if self._strikes[rid] > self.config.max_plan_retries:
                doomed.append(rid)
        for rid in sorted(doomed):
            del self._strikes[rid]
            self._end_request(rid, SeqState.FAILED, error)
        return bool(doomed)

    def _keep_applied_memory(self) -> None:
        """The model or the sampler raised: if the plan's memory ops were applied, keep them
        (tables and memory agree) and drop the step's progress, so the next step computes the
        same tokens again; if they were not (or were undone), roll the step back."""
        try:
            if self.runner.ops_applied:
                self.kv.cache.wait_for_plan()
        except PlanExecutionError:
            self.runner.ops_applied = False
        if not self.runner.ops_applied:
            self._rollback()
            return
        self._commit()
        self.scheduler.discard_step()

    # ---- ending requests early -----------------------------------------------------------
    def abort(self, request_id: int) -> RequestOutput:
        """End a request that has not ended, wherever it is (waiting, running, preempted,
        swapped): its memory, blocks and swap space are released now, and its output keeps
        the tokens produced so far with status "aborted" (unfinished samples get finish_reason
        "abort"). Raises UnknownRequestError for an id the engine does not know (never
        submitted, or popped) and RequestEndedError for one that has already ended; nothing
        changes then. Call it between steps (an ``on_token`` callback is between steps)."""
        state = self._request(request_id)
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
        live = {self.scheduler.state_of(s) for s in state.seq_ids
                if s in self._samples and s in self.scheduler.seqs}
        for seq_state in (SeqState.RUNNING, SeqState.SWAPPED):
            if seq_state in live:
                return seq_state.value
        return SeqState.WAITING.value

    def _request(self, request_id: int) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}: never returned by "
                                      f"add_request, or its output was already popped")
        return state

    def _end_request(self, request_id: int, status: SeqState,
                     error: Optional[BaseException] = None) -> None:
        """End a live request ``status`` (ABORTED or FAILED) in one transaction: the scheduler
        releases its sequences and what that frees (swap buffers included) leaves the manager
        as a plan of no sequences, its ops and the dropped placements, run the way a step's
        plan is (``_execute``: with tensor parallelism on every rank). A rank that dies or hangs
        meanwhile closes the engine, as in ``step``."""
        try:
            with self._transaction():
                seq_ids = self.scheduler.abort_request(request_id, status)
                self._execute(StepPlan([], self.kv.manager.take_ops(), finished=list(seq_ids),
                                       tables=self.kv.tables.drop(seq_ids)))
        except TensorParallelError:
            self.close()
            raise
        state = self._requests[request_id]
        reason = "abort" if status is SeqState.ABORTED else "error"
        for seq_id in seq_ids:
            self.scheduler.forget(seq_id)
        for seq_id in state.seq_ids:
            if seq_id in self._samples:
                self._end_sample(seq_id, reason)
        state.remaining = 0
        state.output.status = status.value
        if error is not None:
            state.output.error = RequestError(type(error).__name__, str(error))

    @contextmanager
    def _transaction(self):
        self._begin()
        try:
            yield
        except BaseException:
            self._rollback()
            raise
        self._commit()

