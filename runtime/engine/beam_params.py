"""BeamSearchParams: what a beam-search request asks for, every field validated.

A type of its own, not fields on SamplingParams (vLLM's choice too, ``vllm.sampling_params.
BeamSearchParams``): beam search ranks whole hypotheses by their cumulative logprob, so most of
SamplingParams (n, top_k / top_p / min_p, penalties, logit biases, seeds, stop strings) has no
meaning for it, and a separate type makes passing them impossible instead of silently ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .errors import BeamSearchParamsError
from .sampling import is_int, plain_number

# numpy's int64 / float32 ... read as Python numbers, as SamplingParams reads them (they were
# refused: ``beam_width=np.int64(2)``)
_NUMBER_FIELDS = ("beam_width", "max_new_tokens", "length_penalty", "num_return_beams",
                  "temperature")


@dataclass(frozen=True)
class BeamSearchParams:
    """Deterministic beam search, transformers' ``generate(num_beams=beam_width,
    do_sample=False, length_penalty=..., early_stopping=...)``. Returns the best
    ``num_return_beams`` (default: all ``beam_width``) hypotheses, best first."""
    beam_width: int                        # beams kept each step (transformers' num_beams)
    max_new_tokens: int = 16               # tokens per beam at most
    length_penalty: float = 1.0            # a hypothesis scores logprob_sum / tokens ** this
                                           # (any finite value; -0.0 past float32's range)
    early_stopping: Union[bool, str] = False   # True: stop once beam_width hypotheses are done;
                                           # False: when none can improve at today's length;
                                           # "never": ... at max_new_tokens (length_penalty > 0)
    num_return_beams: Optional[int] = None  # 1..beam_width; None: beam_width
    ignore_eos: bool = False               # True: the model's EOS ids do not end a beam
    stop_token_ids: Tuple[int, ...] = ()   # more ids that end a beam (kept in its tokens)
    temperature: float = 0.0               # vLLM's field; only 0 (deterministic) runs
    cache_salt: Optional[str] = None       # as SamplingParams': prefixes shared only between
                                           # requests with the same salt (None: the default)
    skip_special_tokens: bool = True       # as SamplingParams': special tokens (EOS, chat
                                           # markers) left out of each beam's text

    def __post_init__(self) -> None:
        for name in _NUMBER_FIELDS:
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(map(plain_number,
                                                                 self.stop_token_ids)))
        for name, ok, allowed in _RULES:
            if not ok(self):
                raise BeamSearchParamsError(f"BeamSearchParams.{name} must be {allowed}, got "
                                            f"{getattr(self, name)!r}", name)

    @property
    def returned_beams(self) -> int:
        return self.beam_width if self.num_return_beams is None else self.num_return_beams


def _is_finite_float(value) -> bool:
    """A finite float, or an int a float holds (10**400 raised OverflowError in isfinite)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


_RULES = (
    ("beam_width", lambda p: is_int(p.beam_width) and p.beam_width >= 1, "an int >= 1"),
    ("max_new_tokens", lambda p: is_int(p.max_new_tokens) and p.max_new_tokens >= 1,
     "an int >= 1"),
    ("length_penalty", lambda p: isinstance(p.length_penalty, (int, float))
     and not isinstance(p.length_penalty, bool) and _is_finite_float(p.length_penalty),
     "a finite number (a float)"),
    ("early_stopping", lambda p: isinstance(p.early_stopping, bool) or p.early_stopping == "never",
     'True, False or "never"'),
    ("num_return_beams", lambda p: p.num_return_beams is None or (
        is_int(p.num_return_beams) and 1 <= p.num_return_beams <= p.beam_width),
     "None or an int in [1, beam_width]"),
    ("ignore_eos", lambda p: isinstance(p.ignore_eos, bool), "a bool"),
    ("stop_token_ids", lambda p: isinstance(p.stop_token_ids, tuple) and len(p.stop_token_ids)
     <= 1024 and all(is_int(t) and t >= 0 for t in p.stop_token_ids),
     "a sequence of at most 1024 int token ids >= 0"),
    ("temperature", lambda p: p.temperature == 0 and not isinstance(p.temperature, bool),
     "0: beam search here is deterministic (transformers' do_sample=False); sampled beam "
     "search is not supported"),
    ("cache_salt", lambda p: p.cache_salt is None or isinstance(p.cache_salt, str)
     and p.cache_salt != "", "None or a non-empty str (vLLM's rule; \"\" was a salt of its own)"),
    ("skip_special_tokens", lambda p: isinstance(p.skip_special_tokens, bool), "a bool"),
)
