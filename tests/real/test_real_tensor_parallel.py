"""SmolLM2-135M-Instruct on three tensor-parallel ranks (9 query heads and 3 KV heads: TP=3; gloo
on the CPU) passes the sharded self-check and answers chat prompts with the single-process
engine's tokens. Its 272 tensors reach the ranks: a forkserver start message carries at most
256 file descriptors, one per shared tensor, so the model is sent after each rank starts."""
from __future__ import annotations

import multiprocessing

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

pytestmark = pytest.mark.real_model


def test_three_ranks_answer_the_chat_prompts_as_one_process(real_model, chat_ids, engine_outputs):
    model, tokenizer = real_model
    assert sum(1 for _ in model.parameters()) > 256
    with Engine(model, tokenizer, cache="paged", max_batch=4, max_context=256,
                tensor_parallel_size=3) as engine:
        assert engine.stats().cache_bytes > 0
        # 4 tokens: each step is 60 activation sums over 3 ranks; the prompts (37 and 53
        # tokens, 16-token blocks) end in the same block after 4 tokens as after 8
        out = engine.generate(chat_ids[:2], SamplingParams(max_new_tokens=4))
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids[:4]
                                                    for o in engine_outputs[:2]]
    assert not multiprocessing.active_children()
