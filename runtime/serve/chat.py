"""``/v1/chat/completions``: messages rendered by the served model's chat template, and choices
shaped as OpenAI's chat completion objects and ``delta`` chunks.

The template is the tokenizer's (a GGUF checkpoint carries one); a request's own
``chat_template`` replaces it only on a server started with ``--trust-request-chat-template``
(else a 400 naming it: a template is code the server runs). A model without one is a 400
naming ``messages`` (the random-weight built-ins have no tokenizer). ``max_completion_tokens`` (or the older
``max_tokens``) defaults to what the context leaves after the prompt (with ``use_beam_search``,
what it leaves a beam search of its beam_width: ``ServedModel.limit_for(beams=...)``).
A rendered conversation provably too long for the context (``text_bounds``: more characters
than the context's tokens can cover) is a 400 naming ``messages`` before it is tokenized.
``logprobs: true`` with ``top_logprobs`` k gives each token's logprob and the k likeliest (the
model's raw distribution). A stream opens every choice with a ``{"role": "assistant"}`` delta.
"""
from __future__ import annotations

from functools import partial
from typing import ClassVar, FrozenSet, List, Optional

from pydantic import Field, model_validator

from vmemkv.runtime.engine.chat import ChatMessageError, ChatTemplateError, chat_prompt_ids
from vmemkv.runtime.engine.sampling import SamplingParams

from .completions import ServedModel
from .errors import ApiError
from .logprobs_format import TokenStrings, chat_logprobs
from .openai_noops import check_no_ops
from .protocol import SamplingFields, parse_request
from .submission import Choice, Delta


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""
    NULLABLE: ClassVar[FrozenSet[str]] = SamplingFields.NULLABLE | {
        "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"}
    messages: List[dict] = Field(min_length=1)   # [{"role", "content"}], checked by the engine's chat
    max_tokens: Optional[int] = Field(None, ge=1)               # OpenAI's older name
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = None      # 0..20 likeliest per token, with logprobs: true
    chat_template: Optional[str] = None     # a Jinja template in place of the model's
    add_generation_prompt: bool = True      # open the assistant's turn after the messages
    # OpenAI's, taken at their no-op values only (openai_noops.py)
    response_format: Optional[dict] = None  # {"type": "text"}: plain text, the default
    tools: Optional[list] = None            # [] only: no tools
    tool_choice: object = None              # "none" only

    @model_validator(mode="after")
    def _only_no_ops(self):
        check_no_ops(self.response_format, self.tools, self.tool_choice)
        return self

    @property
    def max_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def api_name(self, field: str) -> str:
        # the engine's logprobs is a count, top_logprobs here; with none sent, logprobs: true
        top = "top_logprobs" if self.top_logprobs is not None else "logprobs"
        return {"max_new_tokens": self.max_param, "logprobs": top}.get(field, field)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return self.common_sampling(max_tokens,
                                    logprobs=(self.top_logprobs or 0) if self.logprobs else None)


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    return parse_request(body, ChatCompletionRequest)


def chat_token_ids(req: ChatCompletionRequest, served: ServedModel) -> tuple:
    """(the prompt's token ids, max tokens), or ApiError 400 naming the field."""
    adapter = served.check_model(req.model)
    if req.stop_strings() and served.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer; send stop_token_ids instead", "stop")
    if req.chat_template is not None and not served.trust_request_chat_template:
        raise ApiError(400, "this server renders messages with the model's chat template only; "
                            "a request's own chat_template needs the server started with "
                            "--trust-request-chat-template", "chat_template")
    try:
        ids = chat_prompt_ids(served.tokenizer, req.messages, req.chat_template,
                              req.add_generation_prompt,
                              check_text=partial(served.check_text_fits, adapter=adapter,
                                                 field="messages"))
    except ChatMessageError as error:   # one conversation a request: not "conversation 0: ..."
        raise ApiError(400, error.detail, error.field) from None
    except ChatTemplateError as error:
        raise ApiError(400, error.detail, "messages" if req.chat_template is None
                       else "chat_template") from None
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise ApiError(400, f"the rendered messages hold token ids {bad[:5]} outside the "
                            f"model's vocabulary [0, {served.vocab_size})", "messages")
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    beams = served.beam_shape(req)     # a beam search's limit: the engine's for its beams
    max_tokens = given if given is not None else \
        max(1, served.limit_for(len(ids), adapter, beams) - len(ids))
    served.check_lengths(len(ids), max_tokens, req.n, req.max_param, "messages", adapter, beams)
    return ids, max_tokens


class ChatFormat:
    """Choices of a Submission as chat completion objects and ``delta`` chunks."""
    kind = "chat.completion"

    def __init__(self, req: ChatCompletionRequest, served: ServedModel, submission) -> None:
        self.submission, self.want_logprobs = submission, req.logprobs
        self.strings = TokenStrings(served.tokenizer)

    def _logprobs(self, entries) -> Optional[dict]:
        return chat_logprobs(self.strings, entries) if self.want_logprobs else None

    def choice(self, choice: Choice) -> dict:
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": self._logprobs(choice.logprobs),
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids}

    def first_chunks(self) -> List[dict]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in self.submission.choices]

    def chunk(self, delta: Delta) -> dict:
        return {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                "logprobs": self._logprobs(delta.logprobs), "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason, "token_ids": delta.token_ids}
