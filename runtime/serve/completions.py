"""``/v1/completions`` on the HTTP side: prompts checked against the served engine, and choices
(text, token ids, logprobs, the echoed prompt) shaped as OpenAI's completion objects.

With ``echo`` each choice's text starts with its prompt (the prompt as sent when it is text,
else its decoded ids), and with ``logprobs`` too the prompt tokens' logprobs come first (None for
the first token), as lm-evaluation-harness' loglikelihood requests read them. Streamed, the echo
rides on each choice's first chunk.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.runtime.engine.prompts import check_request_params, is_unicode_text
from vmemkv.runtime.engine.sampler import check_min_tokens
from vmemkv.runtime.engine.sampling import SamplingParams
from vmemkv.scheduler.adapters import adapter_limit_tokens

from .errors import ApiError
from .logprobs_format import (StreamedTokens, TextOffsets, TokenStrings, completion_logprobs,
                              echo_offsets, merge_completion_logprobs)
from .protocol import CompletionRequest
from .submission import Choice, Delta, Submission
from .text_bounds import check_text_fits


class ModelNotServedError(ApiError):
    """``model`` names neither the served model nor a loaded adapter: 404 naming ``model``, as
    vLLM and OpenAI answer it (the OpenAI client's ``NotFoundError``; it was a 400, a
    ``BadRequestError``). ``served_ids``: what the server serves now."""

    def __init__(self, model: str, served_ids: List[str]) -> None:
        super().__init__(404, f"model {model!r} is not served here; this server serves "
                              f"{served_ids}", "model")


@dataclass(frozen=True)
class BeamShape:
    """What a beam search's limit depends on besides its prompt: its ``width`` (beam_width)
    and whether it runs to max_tokens (no stop id can end it early), as the engine checks it;
    ``width_param``: the request field that set the width (``n`` where beam_width defaults
    to it), named when the width is at fault."""
    width: int
    runs_to_max_tokens: bool
    width_param: str = "beam_width"


@dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the model's id, its tokenizer and the engine's limits."""
    name: str
    tokenizer: object
    vocab_size: int
    max_sequence_tokens: int   # prompt + max_tokens any request may ask for: max_model_len
    max_n: int                 # choices per request: the engine's max_batch
    loras: Callable[[], List[str]] = list   # the engine's adapter names, read at each request
    #   (the engine thread may unload one at any moment after: ``fit`` then raises
    #   ModelNotServedError, the 404 ``check_model`` gives a name not loaded)
    trust_request_chat_template: bool = False   # ServeLimits'
    max_requests: int = 256    # engine requests in flight at most: the server's --max-queue
    eos_ids: Tuple[int, ...] = ()   # the engine's: stop ids unless ignore_eos
    fit: Optional[Callable[[int, Optional[str]], int]] = None
    #   (prompt tokens, adapter name or None) -> prompt + max_tokens that request may ask for
    #   (a windowed model's grows past max_sequence_tokens after a short prompt; an
    #   adapter's pages take from the pool)
    beam_fit: Optional[Callable[[int, BeamShape], int]] = None
    #   (prompt tokens, the search) -> prompt + max_tokens a beam search may ask for: the
    #   engine's own rule (Scheduler.beam_fit_tokens: every beam at full length, and each
    #   beam's own units beside what the group shares within the pool)

    @classmethod
    def of(cls, engine, name: str, limits=None, max_requests: int = 256) -> "ServedModel":
        sched = engine.scheduler

        def adapter_ref(adapter: str):
            try:
                return engine.adapters.ref(adapter)
            except RequestRejectedError:   # unloaded on the engine thread since check_model
                raise ModelNotServedError(adapter, [name] + engine.loras) from None

        def fit(prompt_tokens: int, adapter: Optional[str] = None) -> int:
            # the cache at max_cache_bytes (on a MemoryBudget its reach): a request that fits
            # only once /resize grows it is a 503; a windowed model's layers give memory back,
            # so its limit is per prompt; beside an adapter, the engine's own check's
            prompt_tokens = max(1, prompt_tokens)
            if adapter is None:
                most = sched.fit_tokens(prompt_tokens)[1]
            else:
                most = adapter_limit_tokens(sched, prompt_tokens, adapter_ref(adapter))
            return min(x for x in (sched.max_seq_len, most) if x)

        def beam_fit(prompt_tokens: int, beams: BeamShape) -> int:
            return sched.beam_fit_tokens(max(1, prompt_tokens), beams.width,
                                         beams.runs_to_max_tokens)
        return cls(name, engine.tokenizer, engine.vocab_size, any_prompt_limit(fit),
                   engine.config.max_batch, lambda: engine.loras,
                   bool(limits and limits.trust_request_chat_template), max_requests,
                   tuple(engine.eos_ids), fit, beam_fit)

    def beam_shape(self, req) -> Optional[BeamShape]:
        """The beam search a request (``SamplingFields``) asks for, as its limit depends on it;
        None without ``use_beam_search``. ApiError 400 naming ``beam_width`` (or ``n``, its
        default) past the engine's max_batch: a step runs all of a group's beams together."""
        if not req.use_beam_search:
            return None
        param, width = req.width_param, req.beam_width if req.beam_width is not None else req.n
        self.check_max_batch(param, width, ": a step runs all the beams of a search together")
        stops = tuple(req.stop_token_ids) + (() if req.ignore_eos else self.eos_ids)
        return BeamShape(width, runs_to_max_tokens=not stops, width_param=param)

    def check_max_batch(self, param: str, value: int, why: str = "") -> None:
        """ApiError 400 naming ``param`` when ``value`` sequences pass the engine's max_batch."""
        if value > self.max_n:
            raise ApiError(400, f"{param} must be at most {self.max_n} (the server's "
                                f"--max-batch{why}), got {value}", param)

    def limit_for(self, prompt_tokens: int, adapter: Optional[str] = None,
                  beams: Optional[BeamShape] = None) -> int:
        """prompt + max_tokens a request of ``prompt_tokens`` (on ``adapter``; a beam search:
        ``beams``) may ask for at most."""
        if beams is not None and self.beam_fit is not None:
            return self.beam_fit(prompt_tokens, beams)
        return self.max_sequence_tokens if self.fit is None else self.fit(prompt_tokens, adapter)

    def check_text_fits(self, text: str, adapter: Optional[str], field: str) -> None:
        """ApiError 400 naming ``field`` when ``text`` provably holds more tokens than any
        request on ``adapter`` may: found before tokenizing it (``text_bounds``)."""
        check_text_fits(text, self.tokenizer, lambda tokens: self.limit_for(tokens, adapter),
                        field)

    def model_limit(self, adapter: Optional[str] = None) -> int:
        """/v1/models' max_model_len of the base model or ``adapter``: what any prompt may ask,
        read now (on a MemoryBudget it follows the share's reach, as ``limit_for`` does)."""
        if self.fit is None:
            return self.max_sequence_tokens
        return any_prompt_limit(lambda p: self.fit(p, adapter))

    def adapter_limits(self) -> Dict[str, int]:
        """Each loaded adapter's ``model_limit``, by name; one the engine thread unloads while
        this reads is left out (as a read a moment later would leave it)."""
        limits = {}
        for adapter in self.loras():
            try:
                limits[adapter] = self.model_limit(adapter)
            except ModelNotServedError:
                continue
        return limits

    def not_served(self, model: str) -> ModelNotServedError:
        """The error for a ``model`` that names nothing served here (the served ids now)."""
        return ModelNotServedError(model, [self.name] + self.loras())

    def check_model(self, model: Optional[str]) -> Optional[str]:
        """The LoRA adapter ``model`` names (None: the base model), or ModelNotServedError 404.
        The adapter may be unloaded right after: the limits then raise the same 404 (``fit``),
        or the engine refuses the request (404 naming ``model``: Submission.started)."""
        if model is None or model == self.name:
            return None
        if model in self.loras():
            return model
        raise self.not_served(model)

    def engine_params(self, params, model: Optional[str]):
        """``params`` as the engine will run them (``with_adapter``), or ApiError 400 naming
        the field where the engine would take them and fail them in their first step."""
        params = self.with_adapter(params, model)
        if isinstance(params, SamplingParams):
            self._check_vocab_ids(params)
            stops = params.stop_token_ids + (() if params.ignore_eos else self.eos_ids)
            try:
                check_min_tokens(params, stops, self.vocab_size)
            except RequestRejectedError as error:
                raise ApiError(400, str(error), error.field) from None
        return params

    def _check_vocab_ids(self, params: SamplingParams) -> None:
        """ApiError 400 naming ``logit_bias`` or ``stop_token_ids`` when it names an id past the
        vocabulary (the engine's own check): a request-wide field, refused as such before
        anything is queued (the engine refused it per prompt, "prompt 0: ...", an index a chat
        or one-prompt client never sent)."""
        try:
            check_request_params(params, self.tokenizer, self.vocab_size, 0)
        except RequestRejectedError as error:
            raise ApiError(400, str(error).removeprefix("prompt 0: "), error.field) from None

    def with_adapter(self, params, model: Optional[str]):
        """``params`` running on the adapter ``model`` names; beam search runs none (400)."""
        lora = self.check_model(model)
        if lora is None:
            return params
        if not isinstance(params, SamplingParams):
            raise ApiError(400, "use_beam_search runs the base model only; a LoRA adapter "
                                f"({lora!r}) cannot run beam search yet", "model")
        return replace(params, lora=lora)

    def check_lengths(self, prompt_tokens: int, max_tokens: int, n: int,
                      max_param: str = "max_tokens", prompt_param: str = "prompt",
                      adapter: Optional[str] = None, beams: Optional[BeamShape] = None) -> None:
        """ApiError 400 naming ``prompt_param`` when the prompt alone fills the context, or
        ``max_param`` when the two together pass it (a beam search that cannot make its first
        decode step while a narrower one can: its width's field); or ``n`` past the engine's
        max_batch."""
        limit = self.limit_for(prompt_tokens, adapter, beams)
        if prompt_tokens + max_tokens > limit:
            if beams is not None and max_tokens > 1 and limit <= prompt_tokens + 1:
                self._check_first_beam_step(prompt_tokens, adapter, beams)
            context = f"this model's context is {limit} tokens"
            if beams is not None and limit < self.model_limit(adapter):
                context += (f" for a beam search of beam_width {beams.width} after a "
                            f"{prompt_tokens}-token prompt")
            elif limit != self.model_limit(adapter) and not beams:
                context += f" after a {prompt_tokens}-token prompt"
            elif adapter is not None:
                context += f" beside adapter {adapter!r}"
            if prompt_tokens >= limit:
                raise ApiError(400, f"{context}; the prompt alone holds {prompt_tokens} tokens",
                               prompt_param)
            raise ApiError(400, f"{context}; the request asks for {prompt_tokens + max_tokens} "
                                f"({prompt_tokens} in the prompt, {max_tokens} {max_param})",
                           max_param)
        self.check_max_batch("n", n)

    def _check_first_beam_step(self, prompt_tokens: int, adapter: Optional[str],
                               beams: BeamShape) -> None:
        """ApiError 400 naming the width's field when a search of ``beams`` cannot make its
        first decode step after the prompt (each beam's own copy of its newest unit does not
        fit beside the prompt's) and a narrower one can: no smaller max_tokens that still
        decodes (2 or more) would fit, a smaller width would. Nothing where one beam cannot
        either (the prompt or max_tokens is at fault, as ``check_lengths`` says)."""
        def decodes(width: int) -> bool:
            shape = replace(beams, width=width)
            return self.limit_for(prompt_tokens, adapter, shape) >= prompt_tokens + 2
        low, high = 0, beams.width - 1     # the widest that decodes (0: none) is in [low, high]
        while low < high:                  # the need only grows with the width
            mid = (low + high + 1) // 2
            low, high = (mid, high) if decodes(mid) else (low, mid - 1)
        if low == 0:                       # one beam cannot decode either: not the width
            return
        raise ApiError(400, f"the server's KV cache cannot hold a beam search of "
                            f"{beams.width} beams ({beams.width_param}) over a "
                            f"{prompt_tokens}-token prompt at its first decode step, where each "
                            f"beam holds its own copy of its newest token's cache unit; the most "
                            f"beams that can decode after this prompt: {low}", beams.width_param)


def prompt_token_ids(req: CompletionRequest, served: ServedModel) -> List[List[int]]:
    """Each prompt as token ids, or ApiError 400 naming ``model``, ``prompt``, ``max_tokens``,
    ``n``, ``beam_width`` or ``stop``."""
    adapter = served.check_model(req.model)
    if len(req.prompts()) > served.max_requests:     # never fits: a 503 would be retried forever
        raise ApiError(400, f"prompt: {len(req.prompts())} prompts, but this server takes at "
                            f"most {served.max_requests} requests in flight (--max-queue); "
                            f"send fewer at a time", "prompt")
    for i, prompt in enumerate(req.prompts()):   # too long to be worth tokenizing
        if isinstance(prompt, str):
            with _which_prompt(i, len(req.prompts())):
                served.check_text_fits(prompt, adapter, "prompt")
    batch = []
    for i, prompt in enumerate(req.prompts()):
        with _which_prompt(i, len(req.prompts())):
            batch.append(_ids(prompt, served))
    beams = served.beam_shape(req)      # these two hold whatever the prompts
    served.check_max_batch("n", req.n)
    for i, ids in enumerate(batch):
        with _which_prompt(i, len(batch)):
            served.check_lengths(len(ids), req.max_tokens, req.n, adapter=adapter, beams=beams)
    if req.stop_strings() and served.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; send stop_token_ids instead", "stop")
    return batch


@contextlib.contextmanager
def _which_prompt(i: int, count: int):
    """An ApiError raised inside names prompt ``i`` when there are several, as the engine's do
    ("prompt has ..." becomes "prompt 1 has ...")."""
    try:
        yield
    except ApiError as error:
        if count > 1:
            own = error.message.startswith("prompt ")
            error.message = (f"prompt {i}{error.message[len('prompt'):]}" if own
                             else f"prompt {i}: {error.message}")
        raise


def _ids(prompt, served: ServedModel) -> List[int]:
    if isinstance(prompt, str):
        if served.tokenizer is None:
            raise ApiError(400, "prompt is text but the served model has no tokenizer; send "
                                "token ids (a list of ints)", "prompt")
        if not is_unicode_text(prompt):
            raise ApiError(400, "prompt holds a lone surrogate (\\ud800-\\udfff escaped in JSON "
                                "without its pair): not Unicode text", "prompt")
        ids = list(served.tokenizer(prompt)["input_ids"])
        if not ids:
            raise ApiError(400, "prompt encodes to no tokens", "prompt")
    else:
        ids = list(prompt)
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise ApiError(400, f"prompt has token ids {bad[:5]} outside the vocabulary "
                            f"[0, {served.vocab_size})", "prompt")
    return ids


class CompletionFormat:
    """Choices of a Submission as completion objects (``choice``) and stream chunks (``chunk``).
    ``text_offset`` indexes the choice's text (echo + output), the same streamed and not:
    ``echo_offsets`` for the prompt, ``TextOffsets`` for the output (the engine's text skips
    special tokens as the request says; a token past a stop string's cut points at the text's
    end; streamed, a token waits until its first character is sent: ``StreamedTokens``)."""
    kind = "text_completion"

    def __init__(self, req: CompletionRequest, served: ServedModel, prompts: Sequence,
                 batch: Sequence[Sequence[int]], submission: Submission) -> None:
        self.submission, self.batch, self.n = submission, batch, req.n
        self.want_logprobs = req.logprobs is not None
        self.strings = TokenStrings(served.tokenizer)
        self.skip_special_tokens = req.skip_special_tokens
        self.echo = ([p if isinstance(p, str) else self._decoded(served, ids)
                      for p, ids in zip(prompts, batch)] if req.echo else None)
        self._echo_offsets: dict = {}   # prompt -> its tokens' text_offset in its echo
        self._streamed: Dict[int, StreamedTokens] = {}   # choice -> its output's tokens

    def _decoded(self, served: ServedModel, ids: Sequence[int]) -> str:
        if served.tokenizer is None:        # the ids in decimal, a space before the output's
            return " ".join(map(str, ids)) + " "
        return served.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo is not None else ""

    def _output_offsets(self, index: int) -> TextOffsets:
        return TextOffsets(self.strings.tokenizer, len(self._echo(index)),
                           self.skip_special_tokens)

    def _prompt_part(self, index: int) -> Optional[dict]:
        prompt = index // self.n
        entries = self.submission.prompt_logprobs[prompt] or [None] * len(self.batch[prompt])
        if prompt not in self._echo_offsets:      # n choices share it
            self._echo_offsets[prompt] = echo_offsets(self.strings.tokenizer, self.batch[prompt],
                                                      self.echo[prompt])
        return completion_logprobs(self.strings, self.batch[prompt], entries,
                                   self._echo_offsets[prompt])

    def choice(self, choice: Choice) -> dict:
        text = self._echo(choice.index) + choice.text
        logprobs = None
        if self.want_logprobs:
            offsets = self._output_offsets(choice.index)
            out = completion_logprobs(self.strings, choice.token_ids, choice.logprobs,
                                      [min(offsets.add(t), len(text)) for t in choice.token_ids])
            logprobs = merge_completion_logprobs([self._prompt_part(choice.index), out]
                                                 if self.echo is not None else [out])
        return {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids}

    def chunk(self, delta: Delta) -> dict:
        """With logprobs a chunk's ``token_ids`` are its logprobs' tokens: those it sends the
        first character of (``StreamedTokens``), the rest held back."""
        echo, parts = "", []
        if delta.index not in self._streamed:   # the choice's first chunk carries the echo
            echo = self._echo(delta.index)
            if self.echo is not None:
                parts.append(self._prompt_part(delta.index))
            self._streamed[delta.index] = StreamedTokens(self._output_offsets(delta.index))
        token_ids, logprobs = delta.token_ids, None
        if self.want_logprobs:
            token_ids, entries, found = self._streamed[delta.index].send(
                echo + delta.text, delta.token_ids, delta.logprobs,
                last=delta.finish_reason is not None)
            out = completion_logprobs(self.strings, token_ids, entries, found)
            logprobs = merge_completion_logprobs(parts + [out])
        return {"index": delta.index, "text": echo + delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason,
                "token_ids": token_ids}

    def first_chunks(self) -> List[dict]:
        return []


def any_prompt_limit(fit: Callable[[int], int]) -> int:
    """The most prompt + max_tokens that every prompt may ask for, ``fit`` giving each
    prompt's limit: the largest L with fit(L - 1) >= L (a longer prompt is allocated whole
    in every layer, so ``fit`` never grows with the prompt)."""
    low, high = 1, max(1, fit(1))             # fit(0) == fit(1): L = 1 always holds
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fit(mid - 1) >= mid else (low, mid - 1)
    return low
