"""Logprobs: what the engine reports about the distribution each token came from.

Which distribution: the model's raw one, ``log_softmax`` of the logits the step computed, in
fp32, before logit_bias, penalties, temperature, top_k / top_p / min_p (vLLM's default,
``raw_logprobs``). So ``exp(logprob)`` of a greedy token is the model's probability for it, a
prompt's summed logprobs are its log-likelihood, and logprobs do not depend on how the request
samples. The logits are the very rows the sampler read in that step.

Prompt logprobs: entry ``i`` (i >= 1) is prompt token ``i`` given tokens ``< i`` (row ``i - 1``
of the prompt's logits); entry 0 is None, as in vLLM. The runner keeps every prompt row's logits
only for sequences that ask (``prompt_rows``); a request asking for prompt logprobs never reads
the prefix cache (as vLLM v1 does), so every entry is computed.

Memory: rows are scored ``LOGPROB_SLICE_ROWS`` at a time, so scoring a 2,048-token prompt on a
131,072-token vocabulary works in ``scoring_bytes`` (136 MiB) instead of [2048, vocab] fp32
log-softmax plus an int64 copy of the comparison (4.6 GB); every op is per row, so the results
are those of scoring all rows at once. The step's logits themselves (every new token's row at
most) are ``step_logits_bytes``, checked beside the KV cache when an engine is built
(``config.cache_budget_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: ``token_id``'s logprob (natural log) and rank in the model's distribution
    there, and the ``top`` k (token id, logprob) pairs, likeliest first (every token, when the
    vocabulary has fewer than k). The rank is 1 + the number of tokens strictly likelier, so
    tied tokens share the best rank and a greedy token (no penalty or bias) is always rank 1
    (vLLM v0's count; vLLM v1 counts the tokens at least as likely: the worst of the tie)."""
    token_id: int
    logprob: float
    rank: int
    top: Tuple[Tuple[int, float], ...] = ()


LOGPROB_SLICE_ROWS = 64     # rows scored at once (rows_logprobs, PromptLogprobs.add)
# bytes per logit of the slice being scored: its rows gathered (<= 4), an fp32 copy (4), their
# log_softmax (4), the comparison with the chosen logprob (1, bool) and its count (4, int32:
# torch casts the bool to the sum's dtype first; the default int64 would be 8)
SCORE_BYTES_PER_LOGIT = 17
LOGIT_BYTES = 4             # a logit in fp32, the widest dtype a model's logits come in


def scoring_bytes(vocab_size: int, max_rows: int = LOGPROB_SLICE_ROWS) -> int:
    """Working memory of scoring logprobs: one slice (``LOGPROB_SLICE_ROWS`` rows, fewer when
    no more than ``max_rows`` come at once)."""
    return min(LOGPROB_SLICE_ROWS, max_rows) * vocab_size * SCORE_BYTES_PER_LOGIT


def step_logits_bytes(max_tokens_per_step: int, max_batch: int, vocab_size: int) -> int:
    """The most memory one engine step's logits use: the model's rows (every new token of the
    step when all of them are prompt rows whose logprobs are asked), a copy of the sampled rows
    (one per running sequence) and the slice being scored, all in fp32."""
    rows = max_tokens_per_step + max_batch
    return rows * vocab_size * LOGIT_BYTES + scoring_bytes(vocab_size, max_tokens_per_step)


def rows_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> List[TokenLogprobs]:
    """Row r of ``logits`` (rows, vocab) scored at ``token_ids[r]``, with its top ``k``; scored
    ``LOGPROB_SLICE_ROWS`` rows at a time (``scoring_bytes``), each row as if alone."""
    token_ids = list(token_ids)
    scored: List[TokenLogprobs] = []
    for begin in range(0, len(token_ids), LOGPROB_SLICE_ROWS):
        end = begin + LOGPROB_SLICE_ROWS
        scored += _slice_logprobs(logits[begin:end], token_ids[begin:end], k)
    return scored


def _slice_logprobs(logits: torch.Tensor, token_ids: List[int], k: int) -> List[TokenLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)                        # (rows, vocab)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)                                            # (rows, 1)
    ranks = (logprobs > chosen).sum(dim=1, dtype=torch.int32) + 1
    if k:   # a vocabulary smaller than k (a 16-token DNA model, logprobs=20): all of it
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [()] * len(ids)
    return [TokenLogprobs(t, lp, rank, top) for t, lp, rank, top in
            zip(ids[:, 0].tolist(), chosen[:, 0].tolist(), ranks.tolist(), tops)]


def token_logprobs(raw: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """One row (vocab,) scored at ``token_id``."""
    return rows_logprobs(raw.unsqueeze(0), [token_id], k)[0]


class PromptLogprobs:
    """A request's prompt logprobs as its prefill chunks run (``add``); ``entries()``: one per
    prompt token, None at position 0 and wherever no step computed it."""

    def __init__(self, prompt_ids: Sequence[int], k: int) -> None:
        self.prompt_ids, self.k = tuple(prompt_ids), k
        self._entries: Dict[int, TokenLogprobs] = {}

    @property
    def complete(self) -> bool:
        return len(self._entries) == len(self.prompt_ids) - 1

    def add(self, first_position: int, logits: torch.Tensor) -> None:
        """``logits`` (rows, vocab): rows of tokens ``first_position ...`` of the sequence; row
        j predicts token ``first_position + j + 1``. Rows past the prompt are ignored; positions
        already known (a recomputed chunk) keep their first value."""
        wanted = [j for j in range(logits.shape[0])
                  if first_position + j + 1 < len(self.prompt_ids)
                  and first_position + j + 1 not in self._entries]
        if not wanted:
            return
        for begin in range(0, len(wanted), LOGPROB_SLICE_ROWS):   # gathered a slice at a time
            part = wanted[begin:begin + LOGPROB_SLICE_ROWS]
            targets = [self.prompt_ids[first_position + j + 1] for j in part]
            rows = logits[torch.tensor(part, device=logits.device)]
            for j, entry in zip(part, rows_logprobs(rows, targets, self.k)):
                self._entries[first_position + j + 1] = entry

    def entries(self) -> List[Optional[TokenLogprobs]]:
        return [self._entries.get(i) for i in range(len(self.prompt_ids))]
