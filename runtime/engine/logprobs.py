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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: ``token_id``'s logprob (natural log) and rank (1: the likeliest) in the
    model's distribution there, and the ``top`` k (token id, logprob) pairs, likeliest first."""
    token_id: int
    logprob: float
    rank: int
    top: Tuple[Tuple[int, float], ...] = ()


def rows_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> List[TokenLogprobs]:
    """Row r of ``logits`` (rows, vocab) scored at ``token_ids[r]``, with its top ``k``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                        # (rows, vocab)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)                                            # (rows, 1)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
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
        targets = [self.prompt_ids[first_position + j + 1] for j in wanted]
        rows = logits[torch.tensor(wanted, device=logits.device)]
        for j, entry in zip(wanted, rows_logprobs(rows, targets, self.k)):
            self._entries[first_position + j + 1] = entry

    def entries(self) -> List[Optional[TokenLogprobs]]:
        return [self._entries.get(i) for i in range(len(self.prompt_ids))]
