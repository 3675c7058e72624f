"""The OpenAI protocol's shared parts: strict request parsing (a 400 naming the field), the
sampling fields both APIs take, usage, stream events; and the completions request.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Every client mistake becomes an ``ApiError`` naming the field (``param``) before anything is
queued: malformed JSON, a body that is not an object, an unknown field, a value of the wrong
type or out of range (the ranges are ``SamplingParams``' own: one rule, one message). Beyond
OpenAI's fields, the server takes vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``skip_special_tokens``). A field OpenAI types "X or null"
(``temperature``, ``top_p``, ``n``, penalties, ``stream``, ``max_tokens``, ``echo``, ...: each
model's ``NULLABLE``; and vLLM's ``beam_width``, with or without ``use_beam_search``) takes JSON
null as "the default", as if it were not sent; null anywhere else is a 400 naming the field.
``seed`` is an int64, as OpenAI's (a 400 outside [-2**63, 2**63 - 1]: wider seeds would alias
narrower ones). Every choice carries its ``token_ids`` (as vLLM's ``return_token_ids`` does),
so clients without a tokenizer can read what was generated. ``best_of`` is taken only when it
equals ``n``: ranking hidden samples is not implemented, and a silent substitute would be
wrong. ``use_beam_search`` (vLLM's extension, with ``beam_width``, default ``n``, and
``length_penalty``) runs ``Engine.beam_search``: the ``n`` best beams are the choices; fields
that shape sampling are refused by name with it.
"""
from __future__ import annotations

import json
from typing import ClassVar, Dict, FrozenSet, List, Optional, Type, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import BeamSearchParamsError, EngineConfigError
from vmemkv.runtime.engine.prompts import is_unicode_text
from vmemkv.runtime.engine.sampling import (MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                            SamplingParams)

from .errors import ApiError, escape_surrogates
from .limits import loads_json

MAX_PROMPTS = 256    # prompts in one completions request at most (each is an engine request)
MAX_MESSAGES = 16384  # chat messages in one request at most
# entries a list or object field may hold, checked before validation, which costs time and
# memory per entry (a 4 MiB body of a million wrong stop values took seconds and a GiB);
# "prompt" may hold more only as one prompt's token ids
FIELD_ENTRIES = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS,
                 "logit_bias": MAX_LOGIT_BIAS, "messages": MAX_MESSAGES, "prompt": MAX_PROMPTS}

Prompts = Union[str, List[int], List[str], List[List[int]]]
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1   # OpenAI's seed is an int64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False   # one last chunk with ``usage`` and no choices


class SamplingFields(BaseModel):
    """The fields both APIs share. Strict: a number is never read from a string, a bool is never
    an int, NaN and infinities are refused, unknown fields are refused (naming them)."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    # the fields OpenAI types "X or null", and beam_width (optional: its default is n): JSON
    # null is their default (not sent, not in model_fields_set); subclasses add their own
    NULLABLE: ClassVar[FrozenSet[str]] = frozenset({
        "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user",
        "frequency_penalty", "presence_penalty", "logit_bias", "beam_width"})

    model: Optional[str] = None           # must be the served model's id when given
    temperature: float = Field(1.0, ge=0.0)   # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)          # vLLM's extension; 0 or -1: all tokens
    min_p: float = 0.0
    n: int = Field(1, ge=1)
    stop: Union[str, List[str], None] = None   # stop strings, not in the text (unless asked)
    stop_token_ids: List[int] = Field(default_factory=list)   # vLLM's extension
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False              # vLLM's extension: keep going past EOS
    user: Optional[str] = None            # accepted, as OpenAI does, and not used
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[Dict[str, float]] = None   # {"token id": bias in [-100, 100]}
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256)   # vLLM's: prefixes
                                          # are shared only between requests with the same salt
    use_beam_search: bool = False         # vLLM's extension: beam search, the n best beams
    beam_width: Optional[int] = Field(None, ge=1)   # beams kept each step (default: n)
    length_penalty: float = 1.0           # vLLM's: a beam scores logprob sum / tokens ** this

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, obj):
        """A nullable field sent as JSON null is dropped: it takes its default."""
        if isinstance(obj, dict):
            return {k: v for k, v in obj.items() if not (v is None and k in cls.NULLABLE)}
        return obj

    def stop_strings(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def common_sampling(self, max_tokens: int, **extra) -> Union[SamplingParams, BeamSearchParams]:
        """SamplingParams of these fields (and ``extra``), BeamSearchParams with
        ``use_beam_search``, or ApiError 400 naming the field."""
        if self.use_beam_search:
            return self.beam_search(max_tokens, extra)
        for name in ("beam_width", "length_penalty"):
            if name in self.model_fields_set:
                raise ApiError(400, f"{name} needs use_beam_search: true", name)
        fields = dict(max_new_tokens=max_tokens, temperature=self.temperature,
                      top_k=max(self.top_k, 0), top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                      stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
                      n=self.n, stop=tuple(self.stop_strings()),
                      frequency_penalty=self.frequency_penalty,
                      presence_penalty=self.presence_penalty,
                      repetition_penalty=self.repetition_penalty,
                      logit_bias=_token_biases(self.logit_bias), min_tokens=self.min_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
                      **extra)
        try:
            return SamplingParams(**fields)
        except EngineConfigError as error:
            name = str(error).split(" ", 1)[0].removeprefix("SamplingParams.")
            message = str(error).replace(f"SamplingParams.{name}", self.api_name(name)).replace(
                "max_new_tokens", self.api_name("max_new_tokens"))
            raise ApiError(400, message, self.api_name(name)) from None

    def beam_search(self, max_tokens: int, extra: dict) -> BeamSearchParams:
        """BeamSearchParams of these fields (beam_width beams, the n best returned); a field
        beam search does not use (sampling, penalties, stop strings, logprobs) is a 400."""
        unused = [f for f in _NOT_BEAM_FIELDS if f in self.model_fields_set] + [
            self.api_name(f) for f in ("logprobs", "prompt_logprobs") if extra.get(f) is not None]
        if "temperature" in self.model_fields_set and self.temperature != 0:
            unused.insert(0, "temperature")
        if self.include_stop_str_in_output:      # no stop strings to include (false: a no-op)
            unused.append("include_stop_str_in_output")
        if unused:
            raise ApiError(400, f"{unused[0]} is not supported with use_beam_search (beam search "
                                f"is deterministic and returns whole beams)", unused[0])
        try:
            return BeamSearchParams(self.beam_width or self.n, max_new_tokens=max_tokens,
                                    length_penalty=self.length_penalty, num_return_beams=self.n,
                                    ignore_eos=self.ignore_eos,
                                    stop_token_ids=tuple(self.stop_token_ids),
                                    cache_salt=self.cache_salt,
                                    skip_special_tokens=self.skip_special_tokens)
        except BeamSearchParamsError as error:
            name = {"num_return_beams": "n", "max_new_tokens": self.api_name("max_new_tokens"),
                    "beam_width": self.width_param}.get(error.field, error.field)
            raise ApiError(400, beam_message(error, name), name) from None

    @property
    def width_param(self) -> str:
        """The request field that sets a beam search's width: ``n`` where ``beam_width`` was
        left out and defaults to it (an engine refusal of the width names what was sent)."""
        return "beam_width" if self.beam_width is not None else "n"

    def api_name(self, field: str) -> str:
        """The request field a SamplingParams field comes from."""
        return {"max_new_tokens": "max_tokens", "prompt_logprobs": "echo"}.get(field, field)


def beam_message(error: BeamSearchParamsError, param: str) -> str:
    """``error``'s message naming its field as the client sent it (``param``), not as the
    engine's ``BeamSearchParams`` calls it."""
    return str(error).replace(f"BeamSearchParams.{error.field}", param)


# fields a beam search request may not set (they shape sampling, which beam search does not do)
_NOT_BEAM_FIELDS = ("top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
                    "repetition_penalty", "logit_bias", "min_tokens", "stop", "best_of")


def _token_biases(bias: Optional[Dict[str, float]]) -> dict:
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
                       "logit_bias")
    # a key is a token id as OpenAI writes it: ASCII digits, no sign, space, "_" or leading
    # zero ("0504" beside "504" would be one token given two biases)
    # (and at most 19 digits: past int64 no id exists, and int() refuses 4,300 digits)
    odd = next((k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 19
                                        and str(int(k)) == k)), None)
    if odd is not None:
        raise ApiError(400, f"logit_bias: keys must be token ids in decimal (ASCII digits, no "
                            f"sign or leading zero), got {odd[:20]!r}", "logit_bias")
    return {int(k): v for k, v in bias.items()}


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""
    NULLABLE: ClassVar[FrozenSet[str]] = SamplingFields.NULLABLE | {
        "max_tokens", "logprobs", "echo", "best_of"}
    prompt: Prompts                        # text (needs a tokenizer) or token ids, or a list
    max_tokens: int = Field(16, ge=1)      # output tokens per choice
    logprobs: Optional[int] = None         # top logprobs per token (0..20), the chosen one's too
    echo: bool = False                     # the prompt (and its logprobs) before each choice
    best_of: Optional[int] = None          # only best_of == n: no hidden samples are ranked

    def prompts(self) -> list:
        """The prompts as a list (one entry per engine request)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of < self.n:   # never valid (vLLM's rule)
            raise ApiError(400, f"best_of must be at least n ({self.n}), got {self.best_of}",
                           "best_of")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of {self.best_of} with n {self.n} is not supported: "
                                f"ranking hidden samples is not implemented; omit best_of or "
                                f"set it to n", "best_of")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.common_sampling(self.max_tokens, logprobs=self.logprobs,
                                    prompt_logprobs=prompt_logprobs)


def parse_model(body: bytes, model: Type[BaseModel]) -> BaseModel:
    """``body`` as ``model`` (a strict pydantic model), or ApiError 400 naming what is wrong:
    not JSON, not a JSON object, an unknown field, a value of the wrong type or range."""
    obj = loads_json(body)      # 400: not JSON, or nested too deeply (limits.py)
    if not isinstance(obj, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    _check_entries(obj, model)
    odd = next((name for name in obj if not is_unicode_text(name)), None)
    if odd is not None:      # pydantic's message named no field (loc is empty)
        raise ApiError(400, f"the request body has a field name that is not Unicode text (a lone "
                            f"surrogate): {escape_surrogates(odd)[:40]!r}")
    try:
        return model.model_validate(obj)
    except ValidationError as error:
        raise _field_error(error, model) from None


def _check_entries(obj: dict, model: Type[BaseModel]) -> None:
    """ApiError 400 naming the first field of ``model`` holding more entries than
    ``FIELD_ENTRIES`` allows (a list of token ids as ``prompt`` excepted)."""
    for name, most in FIELD_ENTRIES.items():
        value = obj.get(name)
        if name not in model.model_fields or not isinstance(value, (list, dict)) \
                or len(value) <= most:
            continue
        if name == "prompt" and all(type(v) is int for v in value):
            continue
        what = "prompts in one request" if name == "prompt" else "entries"
        raise ApiError(400, f"{name}: at most {most} {what}, got {len(value)}", name)


def parse_request(body: bytes, model: Type[BaseModel]) -> BaseModel:
    """The request in ``body``, or ApiError 400 naming what is wrong with it."""
    request = parse_model(body, model)
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    stops = request.stop_strings()
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings, got "
                            f"{str(stops)[:80]}", "stop")
    if not all(is_unicode_text(s) for s in stops):     # it could never match decoded text
        raise ApiError(400, "stop: a stop string holds a lone surrogate: it is not Unicode text",
                       "stop")
    return request


def parse_completion_request(body: bytes) -> CompletionRequest:
    request = parse_request(body, CompletionRequest)
    prompts = request.prompts()
    empty = next((i for i, p in enumerate(prompts) if len(p) == 0), None)
    if not prompts or (empty is not None and len(prompts) == 1):
        raise ApiError(400, "prompt: should have at least 1 item (an empty prompt or prompt list)",
                       "prompt")
    if empty is not None:          # which one, as every other refusal of one of several says
        raise ApiError(400, f"prompt {empty} is empty (every prompt needs at least 1 token "
                            f"or character)", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts in one request, got "
                            f"{len(prompts)}", "prompt")
    return request


def _field_error(error: ValidationError, model: Type[BaseModel]) -> ApiError:
    """The first error as a 400 naming its field (``param``) and, in the message, where in
    the field it is (``stream_options.include_usage``, ``prompt[1][0]``, ``logit_bias.5``).
    Of a union field's errors, the one that reached deepest (the form the value was closest
    to); a value matching no form's shape names the forms (it named the first form's rule:
    ``prompt: Input should be a valid string`` for a list of token-id lists)."""
    first = error.errors()[0]
    loc = list(first["loc"])
    param = str(loc[0]) if loc else None
    if param is not None:
        union = _is_union(model, param)
        mine = [e for e in error.errors() if e["loc"][:1] == first["loc"][:1]]
        first = max(_first_per_form(mine, union), key=lambda e: _reach(e["loc"], union))
        loc = _client_loc(first["loc"], union)
        if union and len(loc) == 1 and first["type"] != "extra_forbidden":
            forms = dict.fromkeys(str(e["loc"][1]) for e in mine if len(e["loc"]) > 1)
            return ApiError(400, f"{param}: should be one of {', '.join(forms)}"
                                 f"{_shown(first)}", param)
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if first["type"] == "extra_forbidden":
        owner = _model_at(model, loc)
        if owner is None or not owner.model_fields:
            takes = "this route takes no fields (send {} or no body)"
        else:
            whose = "this server takes" if owner is model else f"{where.rsplit('.', 1)[0]} takes"
            takes = f"the fields {whose}: {', '.join(owner.model_fields)}"
        return ApiError(400, f"unknown field {where!r}; {takes}", param)
    return ApiError(400, f"{where}: {first['msg']}{_shown(first)}", param)


def _first_per_form(errors: List[dict], union: bool) -> List[dict]:
    """Each union form's first error (a form's later ones say less: ["a", [1], "b"] as a list of
    ints failed at [0] and [2]); all of them for a field of one form."""
    if not union:
        return errors
    firsts: Dict[object, dict] = {}      # form -> its first error, in the errors' order
    for e in errors:
        firsts.setdefault(e["loc"][1] if len(e["loc"]) > 1 else None, e)
    return list(firsts.values())


def _reach(loc: tuple, union: bool) -> tuple:
    """How far into the value an error's form got: deepest first, then furthest along (["a",
    [1, 2]] is a list of strings up to [1], not a list of ints failing at [0])."""
    where = _client_loc(loc, union)
    return len(where), [p for p in where if isinstance(p, int)]


def _shown(error: dict) -> str:
    """``, got <the value>`` (cut at 60 characters, marked), nothing for an object."""
    if isinstance(error.get("input"), dict):
        return ""
    given = json.dumps(error.get("input"), default=str)
    return f", got {given if len(given) <= 60 else given[:57] + '...'}"   # cut: marked


def _members(annotation) -> list:
    """The forms a field's value may take, None left out: its type, or a union's members."""
    if get_origin(annotation) is Union:
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_union(model: Type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return field is not None and len(_members(field.annotation)) > 1


def _client_loc(loc: tuple, union: bool) -> list:
    """``loc`` as the client wrote the request: a union field's member tag, which pydantic
    puts after the field's name (``("prompt", "list[int]", 0)``), left out."""
    return [loc[0]] + list(loc[2:]) if union and len(loc) > 1 else list(loc)


def _model_at(model: Type[BaseModel], loc: list) -> Optional[Type[BaseModel]]:
    """The pydantic model whose field ``loc``'s last part names (``model`` for a top-level
    one; ``StreamOptions`` for ``stream_options.x``), or None."""
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        sub = None if field is None else next(
            (m for m in _members(field.annotation)
             if isinstance(m, type) and issubclass(m, BaseModel)), None)
        if sub is None:
            return None
        model = sub
    return model


# ---- shared response parts -------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(object_id: str, kind: str, model: str, created_s: int, choices: List[dict],
             usage_: Optional[dict] = None) -> dict:
    """A response or stream chunk of ``kind`` ("text_completion", "chat.completion", ...).
    ``created_s``: the Unix time the request was accepted, the same in every chunk of it."""
    body = {"id": object_id, "object": kind, "created": created_s, "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def sse(data: Union[dict, str]) -> str:
    """One server-sent event (``data: ...`` and a blank line); its JSON's strings in UTF-8, as a
    JSON response's are (``limits.ResponseBounds`` measures them so; ``response_bounds``
    counts the spaces after its separators)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n"
