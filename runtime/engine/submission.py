"""How requests enter an engine: one prompt (``add_request``) or a batch (``generate``,
``chat``, ``stream``), each checked before anything is queued (a mixin over ``Engine``).

A prompt is token ids or text (``prompts.py``), its parameters checked against the engine
(``check_request_params``); a batch is all or nothing: every prompt is checked first
(``check_admissible``), so a prompt that could never fit is refused (RequestRejectedError naming
its index) before any of them runs. A request gets its sample states (seeded from the
request's seed, else the engine's ``seed``); with prompt logprobs it skips the prefix-cache
lookup (every prompt row computed and scored; no hit, no query counted, as vLLM v1), while its
computed full blocks are cached under its usual scope for later requests.
"""
from __future__ import annotations

import functools
import re
from collections import deque
from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence, Tuple, Union

from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.scheduler.errors import CacheShrunkError, RequestTooLargeError
from vmemkv.scheduler.lifecycle import check_length, withdraw_request
from vmemkv.scheduler.request import Request

from .call_checks import check_callback, check_count
from .chat import chat_prompts
from .errors import (CacheShrunkRequestError, EngineBusyError, EngineClosedError,
                     EngineConfigError, RequestRejectedError)
from .outputs import CompletionOutput, EngineStats, RequestOutput, TokenEvent
from .prompts import check_prompt_batch, check_request_params, encode_prompt
from .request_state import OnToken, new_request, new_samples
from .sampler import check_min_tokens
from .sampling import SamplingParams, per_prompt

Prompt = Union[Sequence[int], str]


class RequestSubmission:
    """Submission and the batch API (a mixin over Engine: ``scheduler``, ``adapters``,
    ``tokenizer``, ``vocab_size``, ``eos_ids``, ``device``, ``_requests``, ``_samples``,
    ``_prompt_logprobs``, ``_rng``, ``_next_request``, ``_closed``,
    ``_guard``, ``_sinks``, ``_forgotten``, ``run_until_done``, ``output``, ``stats``)."""
    # the latest batch call's statistics and a finished stream's outputs; before any, none
    # (reading them was an AttributeError)
    last_stats: Optional[EngineStats] = None
    last_outputs: Tuple[RequestOutput, ...] = ()

    def add_request(self, prompt: Prompt, sampling: Optional[SamplingParams] = None,
                    on_token: Optional[OnToken] = None, index: int = 0) -> int:
        """Queue one prompt (token ids, or text with a tokenizer); returns its request id.
        Raises RequestRejectedError (nothing queued) when it is invalid or could never fit,
        EngineClosedError after ``close()``."""
        if self._closed:
            raise EngineClosedError("add_request after close(): this engine's cache is released; "
                                    "build a new Engine")
        params = SamplingParams() if sampling is None else sampling
        if not isinstance(params, SamplingParams):
            raise EngineConfigError(f"sampling must be a SamplingParams or None, got "
                                    f"{type(params).__name__} {str(params)[:60]}")
        check_callback("on_token", on_token)
        ids, text = self._encode(prompt, index)
        check_request_params(params, self.tokenizer, self.vocab_size, index)
        stops = self._stop_ids(params)
        check_min_tokens(params, stops, self.vocab_size, index)     # before anything is queued
        rid, arrival_s = self._next_request, self._now()
        # prompt logprobs need every prompt row computed: such a request reads no prefix cache
        request = Request(rid, len(ids), params.max_new_tokens, prompt_token_ids=ids,
                          stop_token_ids=stops, arrival_s=arrival_s, n=params.n,
                          cache_salt=params.cache_salt,
                          prefix_lookup=params.prompt_logprobs is None,
                          adapter=self.adapters.ref(params.lora, index))
        try:
            seq_ids = self.scheduler.add_request(request)
        except RequestTooLargeError as error:
            raise rejected(error, index) from None
        self._next_request += 1
        out = RequestOutput(rid, ids, [CompletionOutput(i, []) for i in range(params.n)], text,
                            arrival_s=arrival_s)
        state = self._requests[rid] = new_request(out, params, on_token, seq_ids)
        seed = params.seed if params.seed is not None else self._rng.randrange(2**62)
        self._samples.update(new_samples(state, stops, seed, self.device, self.tokenizer))
        if state.prompt_logprobs is not None:
            self._prompt_logprobs[seq_ids[0]] = state
        return rid

    def _stop_ids(self, params: SamplingParams) -> tuple:
        """The ids that end a sample of ``params``: its stop_token_ids, and EOS unless ignored."""
        return params.stop_token_ids + (() if params.ignore_eos else self.eos_ids)

    def _encode(self, prompt: Prompt, index: int):
        return encode_prompt(prompt, index, self.tokenizer, self.vocab_size)

    def check_admissible(self, prompts: Sequence[Prompt], sampling) -> None:
        """Raise RequestRejectedError for the first prompt that ``add_request`` would reject;
        EngineConfigError when ``prompts`` is no batch (``check_prompt_batch``: None was a raw
        TypeError) or ``sampling`` not one SamplingParams or one per prompt."""
        check_prompt_batch(prompts)
        for i, (prompt, params) in enumerate(zip(prompts, per_prompt(prompts, sampling))):
            self.adapters.ref(params.lora, i)    # a name no adapter has: refused, nothing runs
            ids, _ = self._encode(prompt, i)
            check_request_params(params, self.tokenizer, self.vocab_size, i)
            check_min_tokens(params, self._stop_ids(params), self.vocab_size, i)
            try:
                check_length(self.scheduler, len(ids), params.max_new_tokens)
            except RequestTooLargeError as error:
                raise rejected(error, i) from None

    # ---- batch API -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt],
                 sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 on_token: Optional[OnToken] = None) -> List[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. All prompts are checked first:
        if any would be rejected, RequestRejectedError is raised and nothing runs. Steps until
        these requests end. An exception from a step or an ``on_token`` callback reaches the
        caller with its ``request_ids`` set (these requests, left intact: ``run_until_done()``
        resumes them, ``output(rid, pop=True)`` collects them); EngineClosedError if
        ``close()`` (from a callback) ended them. Statistics of the call: ``engine.last_stats``."""
        self._check_awake()
        mark = self._mark()
        ids = self._submit_all(prompts, sampling, on_token)
        kept = self._outputs_of(ids)
        with self._driving(ids, "generate"):
            while self._live(ids):
                self._step_with_retries()
        outputs = self._collect(ids, kept)
        self.last_stats = self.stats(since=mark, outputs=outputs)
        return outputs

    def chat(self, messages, sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             chat_template: Optional[str] = None) -> List[RequestOutput]:
        """``generate`` on one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered by the tokenizer's chat template (or ``chat_template``) with the
        assistant's turn opened (runtime/engine/chat.py: ChatTemplateError without one)."""
        return self.generate(chat_prompts(self.tokenizer, messages, chat_template), sampling)

    def stream(self, prompts: Sequence[Prompt],
               sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None
               ) -> Iterator[TokenEvent]:
        """Yield this call's tokens as they are produced (its requests interleaved, step by
        step), and only its own: a step run meanwhile by another call (``generate``, another
        stream) keeps this stream's tokens for it. Closed early (``break``, ``close()``,
        garbage collection), it aborts its unfinished requests. An exception carries
        ``request_ids`` as in ``generate``; EngineClosedError after the tokens produced before
        ``close()`` ended its requests."""
        pending: deque = deque()
        with self._guarded("stream"):
            self._check_awake()
            mark = self._mark()
            ids = self._submit_all(prompts, sampling, None)
            kept = self._outputs_of(ids)
            self._sinks.update(dict.fromkeys(ids, pending))
        try:
            with self._driving(ids, "stream"):
                while True:
                    while pending:
                        yield pending.popleft()
                    with self._guarded("stream"):
                        if not self._live(ids):
                            break
                        self._step_with_retries()
            with self._guarded("stream"):
                self.last_outputs = self._collect(ids, kept)
                self.last_stats = self.stats(since=mark, outputs=self.last_outputs)
        except GeneratorExit:   # closed early: its requests are nobody's, aborted and forgotten
            self._forget(ids)
            raise
        finally:
            for rid in ids:
                self._sinks.pop(rid, None)

    def _outputs_of(self, ids: Sequence[int]) -> List[RequestOutput]:
        """The output objects of requests just submitted (an ended request's is handed out as
        it is), for ``_collect``."""
        return [self._requests[rid].output for rid in ids]

    def _collect(self, ids: Sequence[int], kept: List[RequestOutput]) -> List[RequestOutput]:
        """A batch call's outputs, each popped; one the caller popped already (``output(rid,
        pop=True)`` from an ``on_token`` callback or a stream's loop, once it ended) is the
        output it had: the call neither raises UnknownRequestError after its work is done
        nor drops the outputs it popped before that one."""
        return [self.output(rid, pop=True) if rid in self._requests else out
                for rid, out in zip(ids, kept)]

    def _forget(self, ids: Sequence[int]) -> None:
        """A closed stream's requests, aborted (where live) and dropped: now when this thread
        may touch the engine and no engine call is under way on it; else (closed or
        garbage-collected on a thread other than the one inside the engine, or inside one of
        the engine's own calls on this thread: a step, close, abort, resize, where an abort
        failed the call or changed what it iterated) by the thread driving it, at its next
        ``step()`` or ``close()``."""
        self._forgotten.extend(ids)
        if self._guard.acquire(blocking=False):
            try:
                if not self._calls_inside:
                    self._drop_forgotten()
            finally:
                self._guard.release()

    def _drop_forgotten(self) -> None:
        """Abort and drop the requests of closed streams (``_forget``), holding the engine."""
        while self._forgotten:
            rid = self._forgotten.pop(0)
            if self._live([rid]):
                self.abort(rid)
            self._requests.pop(rid, None)

    def _live(self, ids: Sequence[int]) -> bool:
        """Whether any of these requests has not ended (one popped has)."""
        return any(rid in self._requests and self._requests[rid].remaining for rid in ids)

    @contextmanager
    def _driving(self, ids: List[int], call: str):
        """A batch call stepping its requests ``ids``: an exception leaving it carries
        ``request_ids``; EngineClosedError if ``close()`` ended some of them meanwhile."""
        with tagged(ids):
            yield
            cut = [rid for rid in ids if rid in self._ended_by_close]
            if cut:
                raise EngineClosedError(
                    f"{call}: close() ended {len(cut)} of its {len(ids)} requests \"aborted\" "
                    f"before they finished (ids {cut}); their partial outputs stay readable "
                    f"(engine.output(rid, pop=True))")

    def _to_streams(self, events: List[TokenEvent]) -> None:
        """An open stream's tokens, kept for it whoever stepped (before ``on_token``)."""
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is not None:
                sink.append(event)

    def _step_with_retries(self) -> List[TokenEvent]:
        """``step()``, retried while its plan fails, at most ``max_plan_retries`` times in a row."""
        self._check_awake()        # asleep, a loop over step() would never end
        failures = 0
        while True:
            try:
                return self.step()
            except PlanExecutionError as error:
                failures += 1
                if failures > self.config.max_plan_retries or not error.rolled_back:
                    raise

    @contextmanager
    def _guarded(self, call: str):
        """Hold the engine for ``call``: the thread inside may re-enter, another thread gets
        EngineBusyError before anything is touched."""
        if not self._guard.acquire(blocking=False):
            raise EngineBusyError(
                f"{call}() while another thread is inside this engine: an engine is "
                f"single-threaded; drive it from one thread (as the server's EngineThread "
                f"does) and hand other threads' work to it")
        self._calls_inside += 1
        try:
            yield
        finally:
            self._calls_inside -= 1
            self._guard.release()

    def _submit_all(self, prompts, sampling, on_token) -> List[int]:
        # a batch call steps: inside a step (an on_token callback) it is EngineBusyError before
        # anything is queued (its requests were left running for nobody, their seeds drawn)
        self._refuse_step_inside_step()
        self.check_admissible(prompts, sampling)   # the batch first, then each prompt
        params = per_prompt(prompts, sampling)
        return self.add_all(lambda i: self.add_request(prompts[i], params[i], on_token, index=i),
                            len(prompts))

    def add_all(self, add, count: int) -> List[int]:
        """``add(i)`` for i in range(count), all or nothing: what only the scheduler can tell
        (a beam group or an adapter that never fits beside its prompt) refuses a later prompt
        after earlier ones were queued, and those are withdrawn (as is everything on an
        interrupt) before the error goes on, the seeds they drew from the engine's generator
        and their request ids given back (the next request is numbered, and unseeded draws,
        as without this call). EngineConfigError, nothing added, unless ``add`` is callable and ``count`` an
        int >= 0."""
        check_callback("add_all: add", add, required=True)
        check_count("add_all: count", count)
        ids: List[int] = []
        seeds, next_request = self._rng.getstate(), self._next_request
        try:
            for i in range(count):
                ids.append(add(i))
        except BaseException:
            for rid in ids:
                self._withdraw(rid)
            self._rng.setstate(seeds)
            self._next_request = next_request   # their ids too: the next request takes the first
            raise
        return ids

    def _withdraw(self, rid: int) -> None:
        """Forget a request no step has seen, as if never added."""
        withdraw_request(self.scheduler, rid)
        state = self._requests.pop(rid)
        for seq_id in state.seq_ids:
            self._samples.pop(seq_id, None)
            self._prompt_logprobs.pop(seq_id, None)
            self._beams.group_of.pop(seq_id, None)
        self._beams.groups.pop(rid, None)


@contextmanager
def tagged(ids: List[int]):
    """An exception leaving a batch call carries ``request_ids``: the call's requests, which
    it leaves in the engine (the innermost call's ids are kept)."""
    try:
        yield
    except BaseException as error:
        if not hasattr(error, "request_ids"):
            try:
                error.request_ids = list(ids)
            except AttributeError:   # an exception type that takes no attribute
                pass
        raise


# every public call that changes an engine: one thread at a time (EngineBusyError); the thread
# inside may call back in (an on_token callback). ``stream`` holds it while it steps.
# (``output`` guards itself when it pops)
GUARDED = ("step", "generate", "chat", "run_until_done", "beam_search", "add_request",
           "add_beam_request", "add_all", "abort", "close", "abandon", "sleep", "wake",
           "resize_cache", "rebalance_memory", "reset_prefix_cache", "add_lora", "remove_lora")


def single_threaded(cls):
    """Class decorator: wrap each of ``cls``'s methods GUARDED in ``_guarded``."""
    for name in GUARDED:
        method = getattr(cls, name)

        def call(self, *args, _method=method, _name=name, **kwargs):
            with self._guarded(_name):
                return _method(self, *args, **kwargs)
        setattr(cls, name, functools.wraps(method)(call))
    return cls


def rejected(error: RequestTooLargeError, index: int,
             default_field: str = "prompt") -> RequestRejectedError:
    """The scheduler's refusal of prompt ``index`` as the engine's (CacheShrunkRequestError
    where the cache, resized back up, would hold it), naming the field it names
    (``default_field`` where it names none)."""
    kind = CacheShrunkRequestError if isinstance(error, CacheShrunkError) else RequestRejectedError
    field = ENGINE_FIELDS.get(error.field, default_field)
    return kind(f"prompt {index} rejected: {without_request_id(error)}", index, field)


# the scheduler's Request fields a refusal names -> the engine's request fields
ENGINE_FIELDS = {"prompt_len": "prompt", "max_tokens": "max_new_tokens", "adapter": "lora",
                 "beam_width": "beam_width"}


def without_request_id(error: RequestTooLargeError) -> str:
    """The scheduler's message without its "request N: " (an id the caller never saw)."""
    return re.sub(r"^request \d+: ", "", str(error))
