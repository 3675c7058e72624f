"""The Sampler: a step's logits -> one token per sequence, after its request's logit processing.

    raw row (the model's logits, fp32)                       <- logprobs are reported from this
      -> logit_bias, min_tokens (stop tokens masked), repetition / frequency / presence penalties
      -> greedy: argmax
         else:   (x - max) / temperature -> top_k -> top_p -> min_p -> one draw

The order is transformers' (and vLLM v0's); vLLM v1 applies min_p before top_k and top_p.

Reproducibility: every sequence owns a ``torch.Generator``. With ``seed`` set, sample i of a
request draws from output i of a SplitMix64 stream seeded with ``seed`` (an int64; its 64 bits
as given), so results do not depend on what else is in the batch, on preemption, or on the
cache layout, and two distinct int64 seeds never give one sample index the same generator
seed (each step of the mix is a bijection of 64 bits). Greedy rows skip the generator entirely.

Numerics: the scores are shifted by their maximum before the division by the temperature (at
least ``SAMPLING_EPS``), so they are <= 0 and never overflow; top_p keeps the likeliest token
whatever its value rounds to in fp32; processed scores are clamped below fp32's largest value
(one score a repetition_penalty < 1 lifts past it keeps its lead; two or more would tie there:
refused, ``check_no_tied_overflow``).
A row whose processed scores are all -inf (a huge repetition_penalty times a negative score
overflows fp32) is refused (``check_some_finite``), never clamped: clamping the bottom would
tie every token (argmax: token 0, not the exact ordering) and would lift min_tokens' mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from .errors import NonFiniteLogitsError, RequestRejectedError
from .logprobs import TokenLogprobs, token_logprobs
from .sampling import SamplingParams


_MASK_64 = 2**64 - 1
_GOLDEN_64 = 0x9E3779B97F4A7C15     # SplitMix64's increment


def splitmix64(seed: int, index: int) -> int:
    """Output ``index`` (0, 1, ...) of a SplitMix64 stream seeded with ``seed``'s low 64 bits:
    an unsigned 64-bit int. For a fixed ``index`` it is a bijection of 64-bit seeds."""
    z = (seed + (index + 1) * _GOLDEN_64) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def make_generator(seed: int, sample_index: int, device: torch.device) -> torch.Generator:
    """The generator of sample ``sample_index`` of a request seeded with ``seed`` (an int64:
    wider ints are taken modulo 2**64), seeded with ``splitmix64(seed, sample_index)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(splitmix64(seed, sample_index))
    return gen


@dataclass
class SampleState:
    """One sequence's sampling state: its params, its generator, which row of this step's
    logits it draws from (``logits_row``, set every step), what its penalties read
    (``prompt_ids``; ``output_ids``: its tokens so far, the engine's list) and the tokens
    ``min_tokens`` masks (``stop_ids``). ``logprobs``: the last sampled token's, when asked."""
    logits_row: int
    params: SamplingParams
    generator: Optional[torch.Generator] = field(default=None)
    prompt_ids: Tuple[int, ...] = ()
    output_ids: List[int] = field(default_factory=list)
    stop_ids: Tuple[int, ...] = ()
    logprobs: Optional[TokenLogprobs] = None


def save_generators(samples: Sequence[SampleState]) -> List[Tuple[torch.Generator, torch.Tensor]]:
    """Each drawing sample's generator with its state now; ``restore_generators`` undoes the
    draws made since, so a step that is not recorded draws the same numbers when it runs again."""
    return [(s.generator, s.generator.get_state()) for s in samples if s.generator is not None]


def restore_generators(saved: Sequence[Tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in saved:
        generator.set_state(state)


class Sampler:
    """Turns a step's logits ``[rows, vocab]`` into one token per SampleState."""

    def sample(self, logits: torch.Tensor, samples: Sequence[SampleState]) -> List[int]:
        """NonFiniteLogitsError when a row a sample reads holds NaN or +inf or is all -inf
        (argmax took the first NaN: a silent token 0)."""
        rows = [s.logits_row for s in samples]
        finite = torch.isfinite(logits.amax(dim=-1))             # one pass: NaN propagates
        if all(s.params.plain_greedy for s in samples):
            picked = torch.stack([logits.argmax(dim=-1), finite.long()])   # one host copy
            if rows != list(range(logits.shape[0])):
                picked = picked[:, torch.tensor(rows, device=logits.device)]
            tokens, ok = picked.tolist()
            check_finite(ok, rows)
            return tokens
        ok = finite.tolist()                                       # one host copy
        check_finite([ok[r] for r in rows], rows)
        return [self._one(logits[s.logits_row], s) for s in samples]

    @staticmethod
    def _one(row: torch.Tensor, sample: SampleState) -> int:
        p = sample.params
        raw = row.float()                                        # (vocab,)
        scores = processed_scores(raw, sample) if p.penalised else raw
        token = int(scores.argmax()) if p.greedy else _draw(scores, sample)
        if p.logprobs is not None:
            sample.logprobs = token_logprobs(raw, token, p.logprobs)
        return token


def check_finite(ok: Sequence, rows: Sequence[int]) -> None:
    """NonFiniteLogitsError naming the logits rows whose ``ok`` is false."""
    bad = [r for r, good in zip(rows, ok) if not good]
    if bad:
        raise NonFiniteLogitsError(f"the model's logits hold NaN or inf (or are all -inf) in "
                                   f"rows {bad[:8]} of this step: no token can be chosen (a "
                                   f"numeric overflow in the model? fp16 overflows first)")


def check_min_tokens(params: SamplingParams, stop_ids: Sequence[int], vocab_size: int,
                     index: Optional[int] = None) -> None:
    """RequestRejectedError (field ``min_tokens``) when ``min_tokens`` masks every token of the
    vocabulary: ``stop_ids`` (the request's stop_token_ids, and the EOS ids unless ignore_eos)
    cover all of it, so no token could be drawn before ``min_tokens`` (sampled: the draw had
    no candidate; greedy: token 0, a stop id, ended the sample at once). ``index``: the
    prompt's in its batch, named in the message."""
    masked = {t for t in stop_ids if 0 <= t < vocab_size}
    if params.min_tokens and len(masked) >= vocab_size:
        raise RequestRejectedError(
            ("" if index is None else f"prompt {index}: ") + f"min_tokens {params.min_tokens} "
            f"masks every stop id until then, and the stop ids (stop_token_ids, and EOS unless "
            f"ignore_eos) cover all {vocab_size} tokens of the vocabulary: no token could be "
            f"chosen; drop a stop id or set min_tokens to 0", index or 0, "min_tokens")


def processed_scores(raw: torch.Tensor, sample: SampleState) -> torch.Tensor:
    """``raw`` (vocab,) after logit_bias, the min_tokens mask and the penalties (a new tensor);
    RequestRejectedError when the min_tokens mask would leave no token (``check_min_tokens``)."""
    p, device = sample.params, raw.device
    scores = raw.clone()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=device)
        biases = torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype, device=device)
        scores.index_add_(0, ids, biases)   # int biases ({eos: 100}) added as fp32 too
    if len(sample.output_ids) < p.min_tokens and sample.stop_ids:
        check_min_tokens(p, sample.stop_ids, scores.shape[0])
        stops = [t for t in sample.stop_ids if t < scores.shape[0]]
        scores[torch.tensor(stops, dtype=torch.long, device=device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(sample.prompt_ids).union(sample.output_ids)), device=device)
        vals = scores[seen]
        scores[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.repetition_penalty < 1.0:
            check_no_tied_overflow(scores, p)
    if (p.frequency_penalty or p.presence_penalty) and sample.output_ids:
        ids, counts = torch.unique(torch.tensor(sample.output_ids, device=device), return_counts=True)
        scores.index_add_(0, ids, -(p.frequency_penalty * counts.float() + p.presence_penalty))
    scores = scores.clamp(max=torch.finfo(torch.float32).max)
    check_some_finite(scores, p, masked=len(sample.output_ids) < p.min_tokens)
    return scores


def check_some_finite(scores: torch.Tensor, params: SamplingParams, masked: bool) -> None:
    """RequestRejectedError when every processed score is -inf, so neither argmax nor a draw
    has a candidate: ``repetition_penalty`` times a negative score overflowed fp32 (the exact
    ordering cannot be kept in fp32), or the min_tokens mask (``masked``) hid every token the
    model's logits left finite. The field named is the first of those the request set."""
    if bool(torch.isfinite(scores.max())):
        return
    field = ("repetition_penalty" if params.repetition_penalty != 1.0
             else "min_tokens" if masked else "logit_bias")
    why = (f"repetition_penalty {params.repetition_penalty:g} times a negative score "
           f"overflows float32" if field == "repetition_penalty" else
           "the model's logits are -inf everywhere else")
    raise RequestRejectedError(
        f"every token's score is -inf after logit_bias, the min_tokens mask and the penalties "
        f"({why}): no token can be chosen exactly; change {field}", 0, field)


def check_no_tied_overflow(scores: torch.Tensor, params: SamplingParams) -> None:
    """RequestRejectedError when ``repetition_penalty`` (< 1) divides two or more positive
    scores past float32's range: clamped, they would tie at its largest value (greedy: the
    lower id; a draw: equal odds), where their exact order differs. One past it keeps its lead."""
    overflowed = int(torch.isposinf(scores).sum())
    if overflowed > 1:
        raise RequestRejectedError(
            f"repetition_penalty {params.repetition_penalty:g} divides {overflowed} positive "
            f"scores past float32's range: they would tie, and their order cannot be kept "
            f"exactly; use a larger repetition_penalty", 0, "repetition_penalty")


def _draw(scores: torch.Tensor, sample: SampleState) -> int:
    p = sample.params
    scores = (scores - scores.max()) / p.temperature              # <= 0: cannot overflow
    if p.top_k and p.top_k < scores.shape[0]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p                # mass before each token
        drop[0] = False                                           # the likeliest always stays
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = scores.softmax(-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)   # the likeliest stays
    return int(torch.multinomial(probs, 1, generator=sample.generator))
