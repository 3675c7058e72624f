"""Beam search's selection rule, pure: one step of a beam group from its beams' logprobs.

The rule is transformers' ``_beam_search`` (5.x; the same as ``BeamSearchScorer``), for one
prompt, scores in fp32 as there:

    acc[b, v] = score[b] + log_softmax(logits[b])[v]         (beams, vocab), fp32
    candidates = top K of acc.flatten(), K = max(2, 1 + #stop ids) * beam_width
    a candidate "hits" when its token is a stop id or the beams reach max_new_tokens
    running  = the first beam_width candidates that do not hit, in order
    finished = candidates among the first beam_width that hit, scored
               acc / generated_tokens ** length_penalty, merged with the earlier ones
               (the best beam_width kept)
    done     = the beams reached max_new_tokens, or no running beam can beat the worst kept
               hypothesis (early_stopping False: at the current length; "never" with a positive
               length penalty: at max_new_tokens), or early_stopping is True and beam_width
               hypotheses are kept

The first step has one beam (the prompt): transformers' other beams start at -1e9, so their
candidates never rank while K <= vocab (checked when the request is submitted).

Every finite length_penalty runs: ``tokens ** length_penalty`` past a float's range is +inf
(``length_divisor``) where Python raises OverflowError. The fp32 scores divided by it are -0.0,
as they already are for any divisor past fp32's 3.4e38, which float32 rounds to +inf too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Tuple

import torch

from .beam_params import BeamSearchParams
from .logprobs import TokenLogprobs


@dataclass(frozen=True)
class Beam:
    """A live beam: its sequence (``seq_id``), its tokens and their logprobs, and its
    cumulative logprob ``score`` (the fp32 sum transformers ranks by)."""
    seq_id: int
    token_ids: Tuple[int, ...]
    logprobs: Tuple[TokenLogprobs, ...]
    score: float


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: ``score`` is its cumulative logprob / generated tokens **
    length_penalty; ``finish_reason`` "stop" (it ends with a stop id) or "length"."""
    token_ids: Tuple[int, ...]
    logprobs: Tuple[TokenLogprobs, ...]
    score: float
    finish_reason: str


@dataclass(frozen=True)
class GroupState:
    """One beam request between steps: live beams in transformers' order (best first), the
    best finished hypotheses (best first, at most beam_width), and whether it is done."""
    params: BeamSearchParams
    stop_ids: Tuple[int, ...]
    beams: Tuple[Beam, ...]
    hyps: Tuple[Hypothesis, ...] = ()
    done: bool = False
    ended_now: int = 0      # candidates the last step ended as hypotheses (tokens sampled
                            # that no beam goes on from; kept or not)

    @property
    def candidates(self) -> int:
        """K: candidates kept each step (enough that beam_width never hit a stop id)."""
        return candidates_per_step(self.params.beam_width, len(self.stop_ids))


def candidates_per_step(beam_width: int, num_stop_ids: int) -> int:
    return max(2, 1 + num_stop_ids) * beam_width


def select(group: GroupState, logprobs: torch.Tensor) -> GroupState:
    """The group after one step; ``logprobs`` (len(group.beams), vocab) fp32 are each beam's
    log_softmax at its last token, rows in ``group.beams`` order. Each new beam keeps its
    parent's ``seq_id`` (the caller forks and renames)."""
    p, beams, k = group.params, group.beams, group.params.beam_width
    vocab = logprobs.shape[1]
    scores = torch.tensor([b.score for b in beams], dtype=torch.float32)
    acc = (logprobs + scores[:, None]).reshape(-1)                     # (beams * vocab,)
    values, index = torch.topk(acc, group.candidates)
    parents, tokens = (index // vocab).tolist(), (index % vocab).tolist()
    chosen = logprobs[index // vocab, index % vocab]                   # (K,) each token's logprob
    ranks = ((logprobs[index // vocab] > chosen[:, None]).sum(dim=1) + 1).tolist()
    generated = len(beams[0].token_ids) + 1
    at_length = generated >= p.max_new_tokens
    candidates = [Beam(beams[b].seq_id, beams[b].token_ids + (t,),
                       beams[b].logprobs + (TokenLogprobs(t, lp, r),), score)
                  for b, t, lp, r, score in zip(parents, tokens, chosen.tolist(), ranks,
                                                values.tolist())]
    hits = [at_length or c.token_ids[-1] in group.stop_ids for c in candidates]
    running = tuple(c for c, hit in zip(candidates, hits) if not hit)[:k]
    penalised = (values[:k] / length_divisor(generated, p.length_penalty)).tolist()
    new = [Hypothesis(c.token_ids, c.logprobs, s,
                      "stop" if c.token_ids[-1] in group.stop_ids else "length")
           for c, hit, s in zip(candidates[:k], hits[:k], penalised) if hit]
    hyps = tuple(sorted(group.hyps + tuple(new), key=lambda h: -h.score)[:k])   # stable: old first
    done = at_length or not running or _stops_early(p, running[0].score, hyps, generated)
    return replace(group, beams=() if done else running, hyps=hyps, done=done,
                   ended_now=len(new))


def _stops_early(p: BeamSearchParams, best_running: float, hyps: Tuple[Hypothesis, ...],
                 generated: int) -> bool:
    """transformers' ``_check_early_stop_heuristic`` and ``early_stopping=True``. One beam is
    greedy decoding (transformers' ``generate(num_beams=1)`` runs greedy, whatever
    ``early_stopping`` says): it ends at its first hypothesis."""
    full = len(hyps) == p.beam_width
    if not full:
        return False
    if p.early_stopping is True or p.beam_width == 1:
        return True
    length = (p.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0
              else generated)
    best = torch.tensor(best_running, dtype=torch.float32) / length_divisor(length,
                                                                            p.length_penalty)
    return not bool(best > torch.tensor(min(h.score for h in hyps), dtype=torch.float32))


def length_divisor(tokens: int, length_penalty: float) -> float:
    """``tokens ** length_penalty`` (transformers' divisor of a hypothesis' score), +inf where
    it passes a float's range: an fp32 score divided by it is -0.0, as by any divisor past
    fp32's range (a Python float pow raised OverflowError there: length_penalty=2000)."""
    try:
        return float(tokens) ** float(length_penalty)
    except OverflowError:
        return math.inf


def returned(group: GroupState) -> List[Hypothesis]:
    """What a done group returns: its best ``num_return_beams`` hypotheses, best first."""
    return list(group.hyps[:group.params.returned_beams])
