"""transformers' beam search as the reference, and equality up to a near-tie between hypotheses."""
from __future__ import annotations

import functools

import torch

from .conftest import reference_model

NEAR_TIE_SCORE = 1e-4   # two hypotheses this close in score may rank either way (fp32 sums)
SCORE_TOL = 1e-4        # our beam scores against transformers' sequences_scores (fp32)


@functools.lru_cache(maxsize=None)
def hf_beams(name: str, prompt: tuple, k: int, max_new_tokens: int, length_penalty: float,
             early_stopping, stop_ids: tuple) -> tuple:
    """transformers' ``generate(num_beams=k, do_sample=False, ...)``, all k hypotheses: each
    (tokens up to and with its first stop id, sequences_scores)."""
    m = reference_model(name)
    ids = torch.tensor([prompt])
    saved = m.generation_config.eos_token_id
    m.generation_config.eos_token_id = list(stop_ids) or None   # None passed means "the default"
    try:
        with torch.inference_mode():   # an explicit mask: a prompt token equal to pad is no pad
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             num_beams=k, num_return_sequences=k, do_sample=False,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             pad_token_id=stop_ids[0] if stop_ids else 0,
                             output_scores=True, return_dict_in_generate=True)
    finally:
        m.generation_config.eos_token_id = saved
    beams = []
    for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        end = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        beams.append((tuple(row[:end]), score))
    return tuple(beams)


def beam_mismatches(outputs, reference) -> list[str]:
    """Why our outputs differ from transformers' (empty when equal): same tokens and scores
    within SCORE_TOL, hypothesis by hypothesis, except where the reference ranks two
    hypotheses within NEAR_TIE_SCORE (then the order there may differ)."""
    problems = []
    for index, (out, ref) in enumerate(zip(outputs, reference)):
        ours = [(tuple(c.token_ids), c.beam_score) for c in out.outputs]
        if len(ours) != len(ref):
            problems.append(f"prompt {index}: {len(ours)} beams, reference {len(ref)}")
            continue
        for rank, ((tokens, score), (ref_tokens, ref_score)) in enumerate(zip(ours, ref)):
            if abs(score - ref_score) > SCORE_TOL:
                problems.append(f"prompt {index} beam {rank}: score {score}, reference {ref_score}")
            if tokens != ref_tokens and not _near_tie(ref, rank):
                problems.append(f"prompt {index} beam {rank}: {tokens}, reference {ref_tokens}")
    return problems


def _near_tie(ref, rank: int) -> bool:
    scores = [s for _, s in ref]
    return any(abs(scores[rank] - scores[j]) < NEAR_TIE_SCORE
               for j in (rank - 1, rank + 1) if 0 <= j < len(scores))
