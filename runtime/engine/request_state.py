"""The engine's state of one request and of each of its samples, and what a sampled token adds
to their outputs: token ids, times, logprobs and text (stop strings included).

A request's samples are its sequences (seq ids from the scheduler); each draws with its own
generator (``sampler.make_generator``), reads its own output for penalties, and has its own
text (``detokenize.IncrementalText``) when the engine has a tokenizer. A request asking for
prompt logprobs has one collector (``logprobs.PromptLogprobs``), fed by its first sequence,
the one that computes the prompt (forked samples share it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .detokenize import IncrementalText
from .logprobs import PromptLogprobs, TokenLogprobs
from .outputs import CompletionOutput, RequestOutput, TokenEvent
from .sampler import SampleState, make_generator
from .sampling import SamplingParams

OnToken = Callable[[TokenEvent], None]


@dataclass
class RequestState:
    """Engine-side state of one request, until its output is collected."""
    output: RequestOutput
    params: SamplingParams
    on_token: Optional[OnToken]
    remaining: int                     # samples not yet ended
    seq_ids: tuple = ()
    prompt_logprobs: Optional[PromptLogprobs] = None

    def record_prompt_logits(self, first_position: int, logits: torch.Tensor) -> None:
        """A prefill chunk's logits (rows from ``first_position``); the output's
        ``prompt_logprobs`` is set once every prompt position has its entry."""
        self.prompt_logprobs.add(first_position, logits)
        if self.prompt_logprobs.complete:
            self.output.prompt_logprobs = self.prompt_logprobs.entries()

    def output_for_caller(self) -> RequestOutput:
        """The output to hand a caller (``Engine.output``): once the request has ended, the
        output itself (the engine no longer touches it); while it runs, a snapshot whose lists
        are copies (the samples; each one's token ids, times and logprobs; the prompt
        logprobs), so an edit to it changes nothing the engine reads (its samples' penalties
        read their token ids) or writes. O(the request's tokens), on this call only."""
        out = self.output
        if not self.remaining:
            return out
        samples = [replace(c, token_ids=list(c.token_ids), token_times_s=list(c.token_times_s),
                           logprobs=None if c.logprobs is None else list(c.logprobs))
                   for c in out.outputs]
        prompt = None if out.prompt_logprobs is None else list(out.prompt_logprobs)
        return replace(out, outputs=samples, prompt_logprobs=prompt)


@dataclass
class SampleRecord:
    """Engine-side state of one sequence (one sample of a request)."""
    request: RequestState
    index: int
    sampling: SampleState
    text: Optional[IncrementalText] = None

    @property
    def completion(self) -> CompletionOutput:
        return self.request.output.outputs[self.index]

    @property
    def stopped_by_text(self) -> bool:
        """A stop string ended its text (the token that completed it is the last)."""
        return self.text is not None and self.text.stopped

    def _stop_reason(self):
        """vLLM's ``stop_reason`` of a sample that ended "stop": the stop string that ended its
        text, else its last token when ``stop_token_ids`` holds it; None (an EOS token)."""
        if self.stopped_by_text:
            return self.text.stopped_by
        last = self.completion.token_ids[-1]
        return last if last in self.request.params.stop_token_ids else None

    def record(self, token: int, now: float, last: bool) -> Tuple[str, Optional[TokenLogprobs]]:
        """Append a sampled token (``last``: the scheduler finished the sample with it);
        returns (the text delta, the token's logprobs or None). With a tokenizer the
        completion's ``text`` is kept at what its deltas showed so far, so a live request's
        output (``Engine.output``) has its text too, not None."""
        completion = self.completion
        completion.token_ids.append(token)
        completion.token_times_s.append(now)
        logprobs = self.sampling.logprobs
        if completion.logprobs is not None:
            completion.logprobs.append(logprobs)
        if self.text is None:
            return "", logprobs
        delta = self.text.add(token, last)
        completion.text = self.text.text
        return delta, logprobs

    def save(self) -> tuple:
        """What ``record``, ``end`` and the engine's ending of this sample change (its output,
        text and its request's count and status), for ``restore``: the step's recording is
        undone when the step is not recorded. Outputs only grow: their lengths are kept."""
        c, request = self.completion, self.request
        return (len(c.token_ids), len(c.token_times_s),
                None if c.logprobs is None else len(c.logprobs), c.finish_reason,
                c.stop_reason, c.text, None if self.text is None else self.text.save(),
                request.remaining, request.output.status)

    def restore(self, saved: tuple) -> None:
        c, request = self.completion, self.request
        (tokens, times, logprobs, c.finish_reason, c.stop_reason, c.text, text,
         request.remaining, request.output.status) = saved
        del c.token_ids[tokens:], c.token_times_s[times:]
        if logprobs is not None:
            del c.logprobs[logprobs:]
        if text is not None:
            self.text.restore(text)

    def end(self, reason: str) -> None:
        """The sample ended ``reason``: its text is flushed (the final decode)."""
        completion = self.completion
        completion.finish_reason = reason
        if reason == "stop":
            completion.stop_reason = self._stop_reason()
        if self.text is not None:
            self.text.finish()
            completion.text = self.text.text


def new_request(output: RequestOutput, params: SamplingParams, on_token: Optional[OnToken],
                seq_ids: Sequence[int]) -> RequestState:
    collector = (PromptLogprobs(output.prompt_token_ids, params.prompt_logprobs)
                 if params.prompt_logprobs is not None else None)
    if collector is not None and collector.complete:   # a one-token prompt: nothing to compute
        output.prompt_logprobs = collector.entries()
        collector = None
    return RequestState(output, params, on_token, params.n, tuple(seq_ids), collector)


def new_samples(state: RequestState, stop_ids: Tuple[int, ...], seed: int, device: torch.device,
                tokenizer) -> Dict[int, SampleRecord]:
    """{seq id: its SampleRecord} for every sample of ``state``."""
    params, out = state.params, state.output
    samples = {}
    for i, seq_id in enumerate(state.seq_ids):
        completion = out.outputs[i]
        if params.logprobs is not None:
            completion.logprobs = []
        gen = None if params.greedy else make_generator(seed, i, device)
        sampling = SampleState(0, params, gen, prompt_ids=out.prompt_token_ids,
                               output_ids=completion.token_ids, stop_ids=stop_ids)
        text = (IncrementalText(tokenizer, params.stop, params.include_stop_str_in_output,
                                params.skip_special_tokens, params.min_tokens, out.request_id)
                if tokenizer is not None else None)
        if text is not None:
            completion.text = text.text      # "" until its first token shows something
        samples[seq_id] = SampleRecord(state, i, sampling, text)
    return samples


def deliver(events, requests: Dict[int, RequestState]) -> None:
    """Each event to its request's ``on_token``, after the step is recorded (so a callback may
    call ``abort``). One that raises an Exception stops no other: every event is delivered, then
    the first error is raised (its token is in the output already). An interrupt
    (KeyboardInterrupt, SystemExit) in a callback goes on at once: the later callbacks of the
    step are not called, their tokens are in the outputs too. The callbacks are read before
    any runs: one that pops an ended request's output (``Engine.output(rid, pop=True)``) stops
    none of the step's events reaching theirs (an n > 1 request's other samples' last events)."""
    first_error = None
    calls = [(requests[event.request_id].on_token, event) for event in events
             if event.request_id in requests and requests[event.request_id].on_token is not None]
    for on_token, event in calls:
        try:
            on_token(event)
        except Exception as error:   # noqa: BLE001 -- raised after the others ran
            first_error = first_error or error
    if first_error is not None:
        raise first_error
