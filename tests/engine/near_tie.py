"""Greedy equality that allows a flip at a near-tie (issue 17 item 8).

Two correct implementations can pick different argmaxes where the reference's top two logits
are within rounding (a different kernel tiling on a GPU). So: the tokens must be equal up to
the first difference, and at that position the reference's top-two margin must be below
``tol``; after it the continuations differ legitimately and are not compared.
"""
from __future__ import annotations

from typing import Sequence

import torch

NEAR_TIE_LOGIT = 1e-3     # fp32 logits from different tilings differ by ~1e-5


def hf_greedy_with_margins(model, batch, max_new_tokens: int):
    """transformers' greedy tokens per prompt and the top-two logit margin at each position."""
    tokens, margins = [], []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt], device=model.device)
            # every prompt token attends: generate would infer a mask that drops the ids equal
            # to the model's pad_token_id (tiny-gemma3's 0), which the engine rightly keeps
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            margins.append([float(s[0].float().topk(2).values.diff().abs()) for s in out.scores])
    return tokens, margins


def near_tie_mismatches(got: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
                        margins: Sequence[Sequence[float]], tol: float = NEAR_TIE_LOGIT) -> list[str]:
    """Why ``got`` is not greedy-equal to ``reference`` up to near-ties; empty when it is."""
    problems = []
    for index, (ours, theirs, margin) in enumerate(zip(got, reference, margins)):
        if len(ours) != len(theirs):
            problems.append(f"request {index}: {len(ours)} tokens, reference {len(theirs)}")
            continue
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is not None and margin[first] >= tol:
            problems.append(f"request {index}: token {first} is {ours[first]}, reference "
                            f"{theirs[first]} with a top-two margin of {margin[first]:.3g} >= {tol}")
    return problems
