"""The second half of a step: what the model sampled is recorded (a mixin over ``Scheduler``).

``update`` appends each sampling sequence's token, publishes what became computed
(``mark_computed``: prefix hits only ever name written K/V), timestamps TTFT and inter-token
latency, forks the n > 1 children and a beam's branches (sharing the parent's memory), and
finishes sequences on ``max_tokens`` or a stop token (memory freed, adapter unpinned); ``finish``
ends one early. The decode loop is the hot path of every step, so it inlines ``_on_sample``.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .errors import SchedulerError, UnknownSequenceError
from .request import Sequence, SeqState


class StepRecording:
    """``update``, the finishing of sequences and forgetting them (a mixin over Scheduler:
    ``running``, ``waiting``, ``seqs``, ``manager``, ``config``, ``metrics``, ``_scheduled``,
    ``_decoded``, ``_step``, ``_publish_stride``, ``_finished_ids``, ``_unfinished_samples``,
    ``_pin``, ``_unpin``, ``_run_beside``)."""

    def update(self, sampled: Dict[int, int], now: Optional[float] = None) -> List[int]:
        """Record the step: every scheduled sequence has its new tokens cached; those that
        sampled get ``sampled[seq_id]`` appended. Finishes sequences on max_tokens or a stop
        token and forks n > 1 children. ``now`` (seconds) timestamps TTFT and inter-token
        latency (default: the step count). Returns the seq ids finished by this update.
        SchedulerError, nothing recorded, when ``sampled`` lacks a sampling sequence's token."""
        self._check_sampled(sampled)
        now = float(self._step) if now is None else now
        finished: List[Sequence] = []
        stride, computed = self._publish_stride, self.manager.mark_computed
        recorded = len(self._decoded)    # tokens appended (not those of sequences ended mid-step)
        for seq, new, sample in self._scheduled:     # prefill chunks (few)
            seq.num_computed += new
            if stride:
                computed(seq.seq_id, seq.num_computed)   # publish on compute
            if sample:
                recorded += 1 + self._on_sample(seq, sampled, now, finished)
        itl = self.metrics.itl_s.values               # trimmed once, after the loop
        for seq in self._decoded:                     # the hot path, inlined _on_sample
            seq.num_computed += 1
            if stride and not seq.num_computed % stride:
                computed(seq.seq_id, seq.num_computed)   # a unit just became full and computed
            tok = sampled[seq.seq_id]
            out = seq.output
            out.append(tok)
            seq.length += 1
            if seq.pending_forks:                     # a beam continued by several children
                recorded += self._fork_children(seq, sampled, tok, now)
            itl.append(now - seq.last_token_s)        # a decode always follows a sample
            seq.last_token_s = now
            if len(out) >= seq.max_tokens or (seq.stop_ids and tok in seq.stop_ids):
                finished.append(seq)
        self.metrics.itl_s.trim()
        self.metrics.generated_tokens += recorded
        self._scheduled, self._decoded = [], []
        if finished:
            self._finish(finished)
        if self.config.check_every_step:
            self.manager.check_integrity()    # every table recomputed (tests)
        if not (self.running or self.swapped):   # idle: a leak shows in counters, O(1)
            self.manager.check_idle()
        return self._finished_ids

    def _check_sampled(self, sampled: Dict[int, int]) -> None:
        missing = [s.seq_id for s in self._decoded if s.seq_id not in sampled] + \
            [s.seq_id for s, _, sample in self._scheduled if sample and s.seq_id not in sampled]
        if missing:
            raise SchedulerError(f"update: sampled has no token for sequence(s) {missing[:8]} "
                                 f"({len(missing)} in all), which this step's plan sampled; "
                                 f"nothing was recorded")

    def _on_sample(self, seq: Sequence, sampled: Dict[int, int], now: float,
                   finished: List[Sequence]) -> int:
        """Append ``seq``'s sampled token; returns the children it forked."""
        tok = sampled[seq.seq_id]
        seq.output.append(tok)
        seq.length += 1
        if seq.last_token_s is None:
            self.metrics.ttft_s.append(now - seq.arrival_s)
        else:
            self.metrics.itl_s.append(now - seq.last_token_s)
        seq.last_token_s = now
        forked = self._fork_children(seq, sampled, tok, now) if seq.pending_forks else 0
        if len(seq.output) >= seq.max_tokens or tok in seq.stop_ids:
            finished.append(seq)
        return forked

    def _fork_children(self, parent: Sequence, sampled: Dict[int, int], parent_tok: int,
                       now: float) -> int:
        """Children share the parent's memory (n > 1: the prompt's; a beam's branch: all of its
        tokens) and its output before this step's token; one that does not fit waits to
        recompute, what it would have shared counted in ``recomputed_tokens``. Returns how
        many (each with its sampled token)."""
        for child_id in parent.pending_forks:
            tok = sampled.get(child_id, parent_tok)
            child = Sequence(child_id, parent.request, parent.output[:-1] + [tok])
            child.last_token_s = now
            self.seqs[child_id] = child
            fits = len(self.running) < self.config.max_running and self.manager.can_fork(parent.seq_id)
            if fits:
                self.manager.fork(parent.seq_id, child_id)
                self._pin(child)          # resident: the parent pins it
                child.num_computed, child.held = parent.num_computed, parent.held
                self._run_beside(child)
            else:
                self.waiting.appendleft(child)
            if len(child.output) >= child.max_tokens or tok in child.stop_ids:
                self._finish([child])
            elif not fits:            # it computes again what it would have shared
                self.metrics.recomputed_tokens += parent.num_computed
        forked, parent.pending_forks = len(parent.pending_forks), ()
        return forked

    def finish(self, seq_id: int) -> None:
        """End a sequence "finished" now, as a stop token would have (the engine's stop
        strings match on text, after ``update``): its memory is freed as a finished one's is.
        No-op for one that has already ended; SchedulerError (nothing changed) for one whose
        children are still to fork (an n > 1 sample before its first token, a branched beam)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence id {seq_id}")
        if seq.state.is_ended:
            return
        if seq.state not in (SeqState.RUNNING, SeqState.WAITING):
            raise SchedulerError(f"sequence {seq_id} is {seq.state.value}; only a running or "
                                 f"waiting sequence can finish (right after update)")
        if seq.pending_forks:     # ended now, they would never exist nor end: nor the request
            raise SchedulerError(f"sequence {seq_id} has {len(seq.pending_forks)} pending "
                                 f"forks (its request's other samples, forked from its next "
                                 f"sampled token); it can finish only after they are forked "
                                 f"(abort_request ends the whole request)")
        self._finish([seq])
        self._drop_ended_from_step()

    def _drop_ended_from_step(self) -> None:
        """Between ``schedule`` and ``update``: sequences ended since (finished, aborted,
        failed) leave the step, so ``update`` records nothing for them (it raised KeyError on
        their request's count, or UnknownSequenceError marking a freed one computed)."""
        self._decoded = [seq for seq in self._decoded if not seq.state.is_ended]
        self._scheduled = [entry for entry in self._scheduled if not entry[0].state.is_ended]

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's record (its outputs were collected); a long-running
        server calls this so ``seqs`` holds only live sequences."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence id {seq_id}")
        if not seq.state.is_ended:
            raise SchedulerError(f"sequence {seq_id} is {seq.state.value}, not ended; only "
                                 f"finished, aborted or failed sequences can be forgotten")
        del self.seqs[seq_id]

    def _finish(self, seqs: List[Sequence]) -> None:
        for seq in seqs:
            if seq.state is SeqState.RUNNING:
                self.manager.free(seq.seq_id)
                self._unpin(seq)
            elif seq.state is SeqState.WAITING:
                self.waiting.remove(seq)
            seq.state = SeqState.FINISHED
            seq.held = 0
            self._finished_ids.append(seq.seq_id)
            rid = seq.request.request_id
            self._unfinished_samples[rid] -= 1
            if not self._unfinished_samples[rid]:
                del self._unfinished_samples[rid]
                self.metrics.num_finished_requests += 1
        self.running = [s for s in self.running if s.state is SeqState.RUNNING]
