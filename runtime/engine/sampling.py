"""SamplingParams (what a request asks for) and the Sampler (logits -> token ids).

Reproducibility: every sequence owns a ``torch.Generator``. With ``seed`` set, sample i of a
request draws from ``seed`` mixed with i, so results do not depend on what else is in the
batch, on preemption, or on the cache layout. Greedy rows skip the generator entirely.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from .errors import EngineConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. ``temperature == 0`` is greedy (top_k / top_p unused)."""
    max_new_tokens: int = 16          # output tokens at most, per sample
    temperature: float = 0.0          # 0: greedy (argmax); > 0: softmax(logits / temperature)
    top_k: int = 0                    # keep the k most likely tokens; 0: all
    top_p: float = 1.0                # keep the smallest set with probability >= top_p; 1: all
    seed: Optional[int] = None        # per-request seed; None: drawn from the engine's seed
    stop_token_ids: Tuple[int, ...] = ()  # finish when one is sampled (it is kept in the output)
    ignore_eos: bool = False          # False: the model's EOS id(s) are added to stop_token_ids
    n: int = 1                        # samples of the prompt; children fork the prompt's cache
    cache_salt: Optional[str] = None  # vLLM's name: the prefix cache is shared only between
                                      # requests with the same salt (None: the shared default)

    def __post_init__(self) -> None:
        stops = self.stop_token_ids
        _check(stops, "stop_token_ids", isinstance(stops, (tuple, list)) and all(_is_int(t) for t in stops),
               "a sequence of int token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        _check(self.max_new_tokens, "max_new_tokens", _is_int(self.max_new_tokens)
               and self.max_new_tokens >= 1, "an int >= 1")
        _check(self.temperature, "temperature", _is_number(self.temperature)
               and self.temperature >= 0, "a number >= 0")
        _check(self.top_k, "top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0")
        _check(self.top_p, "top_p", _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               "a number in (0, 1]")
        _check(self.n, "n", _is_int(self.n) and self.n >= 1, "an int >= 1")
        _check(self.seed, "seed", self.seed is None or _is_int(self.seed), "an int or None")
        _check(self.cache_salt, "cache_salt", self.cache_salt is None
               or isinstance(self.cache_salt, str), "a str or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(value, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise EngineConfigError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def make_generator(seed: int, sample_index: int, device: torch.device) -> torch.Generator:
    """The generator of sample ``sample_index`` of a request seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + sample_index) % (2**63))
    return gen


@dataclass
class SampleState:
    """One sequence's sampling state: its params, its generator, and which row of this step's
    logits it draws from (``logits_row``, set every step). ("Slot" is a vmem batch row.)"""
    logits_row: int
    params: SamplingParams
    generator: Optional[torch.Generator] = field(default=None)


class Sampler:
    """Turns a step's logits ``[rows, vocab]`` into one token per SampleState."""

    def sample(self, logits: torch.Tensor, samples: Sequence[SampleState]) -> List[int]:
        if all(s.params.greedy for s in samples):
            rows = [s.logits_row for s in samples]
            picked = logits.argmax(dim=-1)                      # (rows,)
            if rows != list(range(logits.shape[0])):
                picked = picked[torch.tensor(rows, device=logits.device)]
            return picked.tolist()
        return [self._one(logits[s.logits_row], s) for s in samples]

    @staticmethod
    def _one(row: torch.Tensor, sample: SampleState) -> int:
        p = sample.params
        if p.greedy:
            return int(row.argmax())
        scores = row.float() / p.temperature                     # (vocab,)
        if p.top_k and p.top_k < scores.shape[0]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop = cum - sorted_scores.softmax(-1) >= p.top_p    # keep the first token always
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=sample.generator))


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
