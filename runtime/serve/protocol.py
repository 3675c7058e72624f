"""The OpenAI completions protocol: requests validated field by field, responses, stream chunks,
and errors in OpenAI's JSON shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Every client mistake becomes an ``ApiError`` naming the field (``param``) before anything is
queued: malformed JSON, a body that is not an object, an unknown field, a value of the wrong
type or out of range. Beyond OpenAI's fields, the server takes vLLM's extensions ``top_k``,
``stop_token_ids`` and ``ignore_eos``; every choice carries its ``token_ids`` (as vLLM's
``return_token_ids`` does), so clients without a tokenizer can read what was generated.
"""
from __future__ import annotations

import json
import time
from typing import List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vmemkv.runtime.engine.sampling import SamplingParams

from .errors import ApiError
from .limits import loads_json

MAX_STOP_STRINGS = 4   # OpenAI's limit on ``stop``


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False   # one last chunk with ``usage`` and no choices


class CompletionRequest(BaseModel):
    """``POST /v1/completions``. Strict: a number is never read from a string, a bool is never
    an int, NaN and infinities are refused, unknown fields are refused (naming them)."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: Union[str, List[int]] = Field(min_length=1)   # text (needs a tokenizer) or token ids
    model: Optional[str] = None           # must be the served model's id when given
    max_tokens: int = Field(16, ge=1)     # output tokens per choice
    temperature: float = Field(1.0, ge=0.0)   # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)          # vLLM's extension; 0 or -1: all tokens
    n: int = Field(1, ge=1)
    stop: Union[str, List[str], None] = None   # stop strings, not in the returned text
    stop_token_ids: List[int] = Field(default_factory=list)   # vLLM's extension
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False              # vLLM's extension: keep going past EOS
    user: Optional[str] = None            # accepted, as OpenAI does, and not used
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256)   # vLLM's: prefixes
                                          # are shared only between requests with the same salt

    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature,
                              top_k=max(self.top_k, 0), top_p=self.top_p, seed=self.seed,
                              stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, n=self.n, cache_salt=self.cache_salt)


def parse_completion_request(body: bytes) -> CompletionRequest:
    """The request in ``body``, or ApiError 400 naming what is wrong with it."""
    obj = loads_json(body)      # 400: not JSON, or nested too deeply (limits.py)
    if not isinstance(obj, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        request = CompletionRequest.model_validate(obj)
    except ValidationError as error:
        raise _field_error(error) from None
    stops = request.stop_strings()
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings, got {stops!r}",
                       "stop")
    return request


def _field_error(error: ValidationError) -> ApiError:
    first = error.errors()[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    if first["type"] == "extra_forbidden":
        known = ", ".join(CompletionRequest.model_fields)
        return ApiError(400, f"unknown field {'.'.join(loc)!r}; the fields this server takes: "
                             f"{known}", param)
    given = first.get("input")
    shown = "" if isinstance(given, dict) else f", got {json.dumps(given)[:60]}"
    return ApiError(400, f"{param}: {first['msg']}{shown}", param)


# ---- responses -------------------------------------------------------------------------------
def choice(index: int, text: str, token_ids: List[int], finish_reason: Optional[str]) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "token_ids": token_ids}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(completion_id: str, model: str, choices: List[dict], usage_: Optional[dict]) -> dict:
    """A completion object (``choices`` in index order); a stream chunk when ``usage_`` is None
    and ``choices`` hold deltas."""
    body = {"id": completion_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(data: Union[dict, str]) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
