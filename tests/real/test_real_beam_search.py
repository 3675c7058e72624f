"""SmolLM2-135M-Instruct beam search through the engine equals transformers'
generate(num_beams=4, do_sample=False) on a chat prompt (EOS ends hypotheses where it does)."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import BeamSearchParams

pytestmark = pytest.mark.real_model


def test_beam_search_equals_transformers(real_engine, reference, chat_ids):
    ids = chat_ids[0]                       # "What is the capital of France?"
    params = BeamSearchParams(4, max_new_tokens=10, num_return_beams=2)
    (out,) = real_engine.beam_search([ids], params)
    with torch.inference_mode():
        ref = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                                dtype=torch.long),
                                 max_new_tokens=10, num_beams=4, num_return_sequences=2,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
    eos = set(real_engine.eos_ids)
    for ours, row, score in zip(out.outputs, ref.sequences[:, len(ids):].tolist(),
                                ref.sequences_scores.tolist()):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        assert ours.token_ids == row[:end]
        assert ours.beam_score == pytest.approx(score, abs=1e-4)
    assert out.outputs[0].text and out.status == "finished"
