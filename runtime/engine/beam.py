"""Beam search in the engine: beams are sequences of one beam group in the scheduler
(``scheduler/beam_groups.py``), sharing their cache copy-on-write.

    outs = engine.beam_search(prompts, BeamSearchParams(beam_width=4, max_new_tokens=32))
    outs[0].outputs[0].token_ids, .cumulative_logprob, .beam_score   # best hypothesis first

A beam request starts as one sequence (its prompt). In each step where the group's beams
sample (always together), ``beam_select.select`` re-selects the beams from their logits
(transformers' rule); then, in the step's recording phase, a beam nobody continues is pruned
(its memory freed now), a beam continued by c children keeps the first and branches c - 1
(forked by the scheduler's update: the children share every unit, and the manager copies the
shared partial page or block when the first of them writes it: a CopyExtent / CopyBlock op in
the next step's plan). A done group prunes every beam and its output holds the best
hypotheses, each with its tokens' logprobs (``cumulative_logprob``) and its length-penalised
score (``beam_score``). All of it is inside the step's transaction: an undone step undoes the
selection (``BeamSearches.save``).

Outputs arrive whole: a beam group emits its TokenEvents (every returned beam's tokens) in the
step it is done, none before.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Dict, List, Sequence, Union

import torch

from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.lifecycle import check_length
from vmemkv.scheduler.request import Request

from .beam_params import BeamSearchParams
from .beam_select import (Beam, GroupState, Hypothesis, candidates_per_step, length_divisor,
                          returned, select)
from .call_checks import check_callback
from .detokenize import decode_at_end, decode_tokens
from .errors import BeamSearchParamsError, EngineClosedError, RequestRejectedError
from .outputs import CompletionOutput, RequestOutput, TokenEvent
from .prompts import check_prompt_batch
from .request_state import RequestState
from .sampler import check_finite
from .sampling import SamplingParams
from .submission import rejected


class BeamSearches:
    """The engine's live beam groups: request id -> GroupState, seq id -> request id."""

    def __init__(self) -> None:
        self.groups: Dict[int, GroupState] = {}
        self.group_of: Dict[int, int] = {}

    def live_seq_ids(self, request_id: int) -> List[int]:
        group = self.groups.get(request_id)
        return [] if group is None else [b.seq_id for b in group.beams]

    def save(self, requests: Dict[int, RequestState]) -> tuple:
        """What a step's selection and recording change (restored when it is undone)."""
        outputs = [(requests[rid], list(requests[rid].output.outputs), requests[rid].remaining,
                    requests[rid].output.status) for rid in self.groups if rid in requests]
        return dict(self.groups), dict(self.group_of), outputs

    def restore(self, saved: tuple) -> None:
        groups, group_of, outputs = saved
        self.groups.clear()
        self.groups.update(groups)
        self.group_of.clear()
        self.group_of.update(group_of)
        for state, completions, remaining, status in outputs:
            state.output.outputs[:] = completions
            state.remaining, state.output.status = remaining, status

    def select(self, logits: torch.Tensor, rows: Dict[int, int]) -> Dict[int, GroupState]:
        """Each group whose beams sampled this step, re-selected ({request id: new state});
        ``rows``: {seq id: its row of ``logits``}. Pure: nothing changes until ``apply``."""
        picked: Dict[int, GroupState] = {}
        for rid in dict.fromkeys(self.group_of[s] for s in rows):
            group = self.groups[rid]
            live = [rows[b.seq_id] for b in group.beams]   # the scheduler runs a group whole
            check_finite(torch.isfinite(logits[live].amax(dim=-1)).tolist(), live)
            logprobs = torch.log_softmax(logits[live].float(), dim=-1).cpu()   # (beams, vocab)
            picked[rid] = select(group, logprobs)
        return picked

    def apply(self, scheduler, picked: Dict[int, GroupState], sampled: Dict[int, int]) -> List[int]:
        """Tell the scheduler what the selection decided (before its ``update``): prune the
        beams nobody continues, branch those continued more than once; each continuing beam's
        token goes into ``sampled``. Returns the request ids of the groups now done."""
        done = []
        for rid, new in picked.items():
            # a token that ends a hypothesis is sampled but never appended to a sequence:
            # counted here (the continuing beams' are, by the scheduler's update)
            scheduler.metrics.generated_tokens += new.ended_now
            live = self.live_seq_ids(rid)
            continued = {b.seq_id for b in new.beams}
            gone = [s for s in live if s not in continued]
            scheduler.prune(gone)
            for seq_id in gone:
                scheduler.forget(seq_id)
                del self.group_of[seq_id]
            if new.done:                  # every beam was pruned: the hypotheses are the output
                done.append(rid)
                del self.groups[rid]
            else:
                self.groups[rid] = replace(new, beams=self._branch(scheduler, rid, new.beams,
                                                                   sampled))
        return done

    def _branch(self, scheduler, rid: int, beams, sampled: Dict[int, int]) -> tuple:
        children: Dict[int, List[int]] = {}
        for i, beam in enumerate(beams):
            children.setdefault(beam.seq_id, []).append(i)
        beams = list(beams)
        for parent, indices in children.items():
            sampled[parent] = beams[indices[0]].token_ids[-1]
            for i, child in zip(indices[1:], scheduler.branch(parent, len(indices) - 1)):
                beams[i] = replace(beams[i], seq_id=child)
                sampled[child] = beams[i].token_ids[-1]
                self.group_of[child] = rid
        return tuple(beams)


class BeamSearching:
    """The Engine's beam search (a mixin over its fields: ``scheduler``, ``_requests``,
    ``_beams``, ``tokenizer``, ``eos_ids``, ``vocab_size``, ``config``)."""

    def beam_search(self, prompts: Sequence, params: Union[BeamSearchParams,
                                                          Sequence[BeamSearchParams]]
                    ) -> List[RequestOutput]:
        """Beam search for every prompt; outputs in prompt order, each with the best
        ``num_return_beams`` hypotheses, best first. Every prompt and its params are checked
        first (BeamSearchParamsError, RequestRejectedError: nothing runs). Statistics of the
        call: ``engine.last_stats``."""
        self._check_awake()      # as generate: before anything is queued (it queued, then raised)
        self._refuse_step_inside_step()   # it steps: from an on_token callback, refused first
        check_prompt_batch(prompts)
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts) or not all(isinstance(p, BeamSearchParams) for p in per):
            raise BeamSearchParamsError(f"params must be a BeamSearchParams or one per prompt "
                                        f"({len(prompts)}), got {str(params)[:60]!r}", "params")
        for p in per:
            self.check_beam_params(p)
        self.check_admissible(prompts, [SamplingParams(max_new_tokens=p.max_new_tokens)
                                        for p in per])
        mark = self._mark()
        ids = self.add_all(lambda i: self.add_beam_request(prompts[i], per[i], index=i),
                           len(prompts))
        kept = self._outputs_of(ids)
        self.run_until_done()
        outputs = self._collect(ids, kept)      # one an on_token callback popped is kept
        self.last_stats = self.stats(since=mark, outputs=outputs)
        return outputs

    def check_beam_params(self, params: BeamSearchParams) -> None:
        """BeamSearchParamsError when this engine cannot run ``params`` exactly (or it is not
        a BeamSearchParams: the error names ``params``)."""
        if not isinstance(params, BeamSearchParams):
            raise BeamSearchParamsError(f"params must be a BeamSearchParams, got "
                                        f"{type(params).__name__} {str(params)[:60]!r}", "params")
        if params.beam_width > self.config.max_batch:
            raise BeamSearchParamsError(
                f"BeamSearchParams.beam_width {params.beam_width} exceeds max_batch "
                f"{self.config.max_batch}: a beam group runs its beams in one step", "beam_width")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise BeamSearchParamsError(f"BeamSearchParams.stop_token_ids {bad[:5]} lie outside "
                                        f"the vocabulary [0, {self.vocab_size})", "stop_token_ids")
        keep = candidates_per_step(params.beam_width, len(self._beam_stop_ids(params)))
        if keep > self.vocab_size:
            raise BeamSearchParamsError(
                f"BeamSearchParams.beam_width {params.beam_width} needs {keep} candidates a "
                f"step, more than the vocabulary's {self.vocab_size} tokens", "beam_width")

    def _beam_stop_ids(self, params: BeamSearchParams) -> tuple:
        eos = () if params.ignore_eos else tuple(self.eos_ids)
        return tuple(dict.fromkeys(eos + params.stop_token_ids))

    def add_beam_request(self, prompt, params: BeamSearchParams, index: int = 0,
                         on_token=None) -> int:
        """Queue one beam-search prompt; returns its request id (its output: ``output``).
        ``on_token`` (callable or None, else EngineConfigError: nothing queued) gets the
        returned beams' tokens in the step the search is done."""
        if self._closed:
            raise EngineClosedError("add_beam_request after close(): build a new Engine")
        check_callback("on_token", on_token)
        self.check_beam_params(params)
        ids, text = self._encode(prompt, index)
        rid, arrival_s = self._next_request, self._now()
        request = Request(rid, len(ids), params.max_new_tokens, prompt_token_ids=ids,
                          arrival_s=arrival_s, beam_width=params.beam_width,
                          cache_salt=params.cache_salt,
                          runs_to_max_tokens=not self._beam_stop_ids(params))   # no early end
        try:
            check_length(self.scheduler, len(ids), params.max_new_tokens)   # one beam fits,
        except RequestTooLargeError as error:
            raise rejected(error, index) from None
        try:
            (seq_id,) = self.scheduler.add_request(request)
        except RequestTooLargeError as error:   # its group does not, or all at full length
            raise rejected(error, index, "beam_width") from None
        self._next_request += 1
        out = RequestOutput(rid, ids, [], text, arrival_s=arrival_s)
        limits = SamplingParams(max_new_tokens=params.max_new_tokens)   # what RequestState reads
        self._requests[rid] = RequestState(out, limits, on_token, 1, (seq_id,))
        self._beams.groups[rid] = GroupState(params, self._beam_stop_ids(params),
                                             (Beam(seq_id, (), (), 0.0),))
        self._beams.group_of[seq_id] = rid
        return rid

    # ---- inside a step ---------------------------------------------------------------------
    def _beam_events(self, done: List[int], picked: Dict[int, GroupState], now: float
                     ) -> List[TokenEvent]:
        """Done groups: their outputs filled, the request finished; the returned beams' tokens
        as events."""
        events = []
        for rid in done:
            state = self._requests[rid]
            state.output.outputs[:] = [self._completion(rid, i, h, picked[rid].params)
                                       for i, h in enumerate(returned(picked[rid]))]
            state.remaining, state.output.status = 0, "finished"
            for c in state.output.outputs:   # the beam's text rides on its last token
                c.token_times_s = [now] * len(c.token_ids)   # every token arrives now
                last = len(c.token_ids) - 1
                events += [TokenEvent(rid, c.index, t, j == last, c.finish_reason if j == last
                                      else None, c.text or "" if j == last else "", c.logprobs[j],
                                      c.stop_reason if j == last else None)
                           for j, t in enumerate(c.token_ids)]
        return events

    def _completion(self, request_id: int, index: int, h: Hypothesis, params: BeamSearchParams,
                    ending: bool = False) -> CompletionOutput:
        """``h`` as output ``index`` of request ``request_id``, its text decoded as
        ``params.skip_special_tokens`` says. ``ending`` (the request ended early: aborted,
        failed, closed): no text when the tokenizer fails (``decode_at_end``); otherwise (a
        done group, inside its step) a TokenDecodeError, which fails this request alone."""
        text = None
        if self.tokenizer is not None:
            decode = partial(decode_tokens, self.tokenizer, h.token_ids,
                             params.skip_special_tokens, request_id)
            text = decode_at_end(decode) if ending else decode()
        last = h.token_ids[-1] if h.token_ids else None   # vLLM's stop_reason: a stop_token_id
        stop = last if h.finish_reason == "stop" and last in params.stop_token_ids else None
        return CompletionOutput(index, list(h.token_ids), h.finish_reason, text,
                                logprobs=list(h.logprobs), beam_score=h.score, stop_reason=stop)

    def _end_beams(self, request_id: int, reason: str) -> None:
        """A beam request ended early (aborted, failed, closed): its output holds what it has,
        the finished hypotheses and the live beams (finish_reason ``reason``) scored alike
        (``_live_score``), best first (a finished one first on a tie), at most
        num_return_beams."""
        group = self._beams.groups.pop(request_id, None)
        if group is None:
            return
        for beam in group.beams:
            self._beams.group_of.pop(beam.seq_id, None)
        live = [Hypothesis(b.token_ids, b.logprobs, _live_score(b, group.params.length_penalty),
                           reason) for b in group.beams]
        ranked = sorted(list(group.hyps) + live, key=lambda h: -h.score)   # stable
        self._requests[request_id].output.outputs[:] = [
            self._completion(request_id, i, h, group.params, ending=True)
            for i, h in enumerate(ranked[:group.params.returned_beams])]


def _live_score(beam: Beam, length_penalty: float) -> float:
    """A live beam's ``beam_score`` as a finished hypothesis' is scored: its fp32 cumulative
    logprob over tokens ** length_penalty (0.0 with no token yet: nothing to divide)."""
    if not beam.token_ids:
        return beam.score
    score = torch.tensor(beam.score, dtype=torch.float32)
    return (score / length_divisor(len(beam.token_ids), length_penalty)).item()
