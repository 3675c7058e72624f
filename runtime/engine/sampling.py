"""SamplingParams: what a request asks for, every field validated (a typed error naming it).

The Sampler that turns logits into tokens is ``sampler.py``; ``logprobs.py`` reports them.

Numerics (hardened, issue 27): a temperature below ``SAMPLING_EPS`` (1e-5, vLLM's
``_SAMPLING_EPS``) is greedy, so a subnormal temperature can never overflow ``logits / T``;
``top_p`` always keeps the likeliest token; nan, infinities and out-of-range values of every
float field are refused here, before anything is queued. Lists a client sends (stop token ids,
stop strings, logit biases) are capped (``MAX_*``), so one request cannot slow every step.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

from .errors import EngineConfigError

SAMPLING_EPS = 1e-5          # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20            # top logprobs per position at most (OpenAI's top_logprobs limit)
MAX_STOP_TOKEN_IDS = 1024    # stop_token_ids entries at most
MAX_STOP_STRINGS = 16        # stop strings at most
MAX_STOP_STRING_CHARS = 1024  # characters per stop string at most
MAX_LOGIT_BIAS = 1024        # logit_bias entries at most
MAX_SAMPLES = 1024           # n at most: each sample is a sequence every step copies on its
                             # savepoint (n=4,000 took 4 s for 2 tokens; send more requests)
LOGIT_BIAS_RANGE = 100.0     # each bias in [-100, 100], as OpenAI
PENALTY_RANGE = 2.0          # frequency / presence penalties in [-2, 2], as OpenAI
FP32_MAX = 3.4028234663852886e38   # temperature and repetition_penalty must stay finite in fp32
FP32_TINY = 1.1754943508222875e-38  # ... and nonzero (the smallest normal fp32)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. A temperature below ``SAMPLING_EPS`` is greedy (top_k,
    top_p and min_p unused). Processing order (transformers' and vLLM v0's; vLLM v1 applies
    min_p before top_k / top_p): logit_bias, min_tokens (stop tokens masked), repetition /
    frequency / presence penalties, then greedy argmax or temperature, top_k, top_p, min_p and
    a draw. Logprobs are of the model's raw distribution (see ``logprobs``). Numbers may be
    numpy scalars: they are stored as Python ints and floats."""
    max_new_tokens: int = 16          # output tokens at most, per sample
    temperature: float = 0.0          # < 1e-5: greedy (argmax); else softmax(logits / temperature)
    top_k: int = 0                    # keep the k most likely tokens; 0 (or vLLM's -1): all
    top_p: float = 1.0                # keep the smallest set with probability >= top_p; 1: all
    min_p: float = 0.0                # drop tokens below min_p x the likeliest's probability
    seed: Optional[int] = None        # per-request seed; None: drawn from the engine's seed
    stop_token_ids: Tuple[int, ...] = ()  # finish when one is sampled (it is kept in the output)
    ignore_eos: bool = False          # False: the model's EOS id(s) are added to stop_token_ids
    n: int = 1                        # samples of the prompt; children fork the prompt's cache
    cache_salt: Optional[str] = None  # vLLM's name: the prefix cache is shared only between
                                      # requests with the same salt (None: the shared default)
    stop: Tuple[str, ...] = ()        # stop strings on the text (needs a tokenizer): the sample
                                      # ends "stop" where one appears; cut from the text unless
    include_stop_str_in_output: bool = False   # this is set
    skip_special_tokens: bool = True  # leave special tokens (EOS, chat markers) out of the text
    min_tokens: int = 0               # no stop token (EOS, stop_token_ids) nor stop string
                                      # before this many
    repetition_penalty: float = 1.0   # > 0; logits of tokens in prompt or output: / p if > 0, * p if < 0
    frequency_penalty: float = 0.0    # [-2, 2]: minus this x the token's count in the output
    presence_penalty: float = 0.0     # [-2, 2]: minus this once if the token is in the output
    logit_bias: Tuple[Tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]); a dict
                                      # is accepted and stored as sorted pairs
    logprobs: Optional[int] = None    # per sampled token: its logprob, rank and the top k (0..20)
    prompt_logprobs: Optional[int] = None   # per prompt token after the first: the same (0..20)
    lora: Optional[str] = None        # a LoRA adapter added with Engine.add_lora (None: the base
                                      # model); its content digest keys the prefix cache

    def __post_init__(self) -> None:
        _normalise(self)
        for name, ok, allowed in _RULES:
            _check(getattr(self, name), name, ok(self), allowed)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalised(self) -> bool:
        """Any logit processing before the draw (penalties, biases, min_tokens)."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits, nothing reported: the batched argmax path."""
        return self.greedy and not self.penalised and self.logprobs is None


_NUMBER_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "n",
                  "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty",
                  "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")


def plain_number(value):
    """A number (numpy's int64, float32, ...) as a Python int (numbers.Integral) or float
    (numbers.Real); anything else (bools, non-numbers) as given, for _RULES to refuse."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _normalise(p: SamplingParams) -> None:
    """Numbers to Python ints / floats, lists to tuples, a logit_bias mapping to sorted pairs
    (each checked by _RULES)."""
    for name in _NUMBER_FIELDS:
        object.__setattr__(p, name, plain_number(getattr(p, name)))
    for name in _FLOAT_FIELDS:   # an int as a float: temperature=10**30 passed the range check
        value = getattr(p, name)  # and torch's division overflowed; one past a float's range
        if is_int(value) and abs(value) <= FP32_MAX:   # stays an int, for _RULES to refuse
            object.__setattr__(p, name, float(value))
    if p.top_k == -1 and is_int(p.top_k):   # vLLM's "all tokens", stored as 0
        object.__setattr__(p, "top_k", 0)
    for name in ("stop_token_ids", "stop", "logit_bias"):   # vLLM's Optional: None is none
        if getattr(p, name) is None:
            object.__setattr__(p, name, ())
    for name in ("stop_token_ids", "stop"):
        value = getattr(p, name)
        if isinstance(value, str) and name == "stop":
            value = (value,)
        if isinstance(value, (list, tuple)):
            object.__setattr__(p, name, tuple(map(plain_number, value)))
    bias = p.logit_bias
    if isinstance(bias, Mapping):   # int ids in order, then any other key (refused by _RULES)
        bias = tuple(sorted(((plain_number(t), b) for t, b in bias.items()),
                            key=lambda kv: (0, kv[0]) if is_int(kv[0]) else (1, 0)))
    if isinstance(bias, (list, tuple)):
        object.__setattr__(p, "logit_bias", tuple(tuple(map(plain_number, e))
                                                  if isinstance(e, (list, tuple)) else e
                                                  for e in bias))


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    """An int (any: math.isfinite raised OverflowError on 10**400) or a finite float."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _in(low: float, high: float):
    return lambda v: _is_finite(v) and low <= v <= high


def _optional_count(value) -> bool:
    return value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS)


def _bias_ok(p: SamplingParams) -> bool:
    bias = p.logit_bias
    return (isinstance(bias, tuple) and len(bias) <= MAX_LOGIT_BIAS
            and all(isinstance(e, tuple) and len(e) == 2 and is_int(e[0]) and e[0] >= 0
                    and _in(-LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)(e[1]) for e in bias)
            and len({e[0] for e in bias}) == len(bias))


def _stops_ok(p: SamplingParams) -> bool:
    return (isinstance(p.stop, tuple) and len(p.stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in p.stop))


# (field, rule, what it must be): every field, checked in this order
_RULES = (
    ("max_new_tokens", lambda p: is_int(p.max_new_tokens) and p.max_new_tokens >= 1, "an int >= 1"),
    ("temperature", lambda p: _in(0.0, FP32_MAX)(p.temperature),
     "a finite number >= 0, at most 3.4e38 (float32's largest)"),
    ("top_k", lambda p: is_int(p.top_k) and p.top_k >= 0, "an int >= 0 (0 or -1: all tokens)"),
    ("top_p", lambda p: _is_finite(p.top_p) and 0.0 < p.top_p <= 1.0, "a number in (0, 1]"),
    ("min_p", lambda p: _in(0.0, 1.0)(p.min_p), "a number in [0, 1]"),
    ("seed", lambda p: p.seed is None or (is_int(p.seed) and -2**63 <= p.seed < 2**63),
     "an int or None, in [-2**63, 2**63 - 1] (an int64: wider seeds would alias narrower ones)"),
    ("stop_token_ids", lambda p: isinstance(p.stop_token_ids, tuple)
     and len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS
     and all(is_int(t) and t >= 0 for t in p.stop_token_ids),
     f"a sequence of at most {MAX_STOP_TOKEN_IDS} int token ids >= 0"),
    ("ignore_eos", lambda p: isinstance(p.ignore_eos, bool), "a bool"),
    ("n", lambda p: is_int(p.n) and 1 <= p.n <= MAX_SAMPLES, f"an int in [1, {MAX_SAMPLES}]"),
    ("cache_salt", lambda p: p.cache_salt is None or isinstance(p.cache_salt, str)
     and p.cache_salt != "", "None or a non-empty str (vLLM's rule; \"\" was a salt of its own)"),
    ("stop", _stops_ok, f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
                        f"{MAX_STOP_STRING_CHARS} characters"),
    ("include_stop_str_in_output", lambda p: isinstance(p.include_stop_str_in_output, bool), "a bool"),
    ("skip_special_tokens", lambda p: isinstance(p.skip_special_tokens, bool), "a bool"),
    ("min_tokens", lambda p: is_int(p.min_tokens) and 0 <= p.min_tokens <= p.max_new_tokens,
     "an int in [0, max_new_tokens]"),
    ("repetition_penalty", lambda p: _in(FP32_TINY, FP32_MAX)(p.repetition_penalty),
     "a number in [1.2e-38, 3.4e38] (> 0 in float32's range; 1: none)"),
    ("frequency_penalty", lambda p: _in(-PENALTY_RANGE, PENALTY_RANGE)(p.frequency_penalty),
     f"a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]"),
    ("presence_penalty", lambda p: _in(-PENALTY_RANGE, PENALTY_RANGE)(p.presence_penalty),
     f"a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]"),
    ("logit_bias", _bias_ok, f"a mapping of at most {MAX_LOGIT_BIAS} token ids (ints >= 0) to "
                             f"biases in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"),
    ("logprobs", lambda p: _optional_count(p.logprobs), f"None or an int in [0, {MAX_LOGPROBS}]"),
    ("prompt_logprobs", lambda p: _optional_count(p.prompt_logprobs),
     f"None or an int in [0, {MAX_LOGPROBS}]"),
    ("lora", lambda p: p.lora is None or (isinstance(p.lora, str) and 0 < len(p.lora) <= 256),
     "None or an adapter name of 1-256 characters"),
)


def _check(value, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise EngineConfigError(f"SamplingParams.{name} must be {allowed}, got {shown}")


def per_prompt(prompts, sampling) -> List[SamplingParams]:
    """One SamplingParams per prompt: ``sampling`` as given, or None (the defaults), or a list."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or SamplingParams()] * len(prompts)
    if not isinstance(sampling, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in sampling):
        raise EngineConfigError(f"sampling must be a SamplingParams or a list of them (one per "
                                f"prompt), got {type(sampling).__name__} {str(sampling)[:40]!r}; "
                                f"greedy decoding is SamplingParams(temperature=0), the default")
    if len(sampling) != len(prompts):
        raise EngineConfigError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    return list(sampling)

