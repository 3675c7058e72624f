"""The tensor-parallel shard check runs within the engine's ``max_context``, as the one-process
self-check does: a dynamic-NTK model whose threshold (32 positions) ``max_context`` respects
was refused under TP (the check's 42 positions grew its rotary frequencies), and runs exact."""
from __future__ import annotations

from ..hf.test_model_positions_hunt30 import PROMPTS, engine_greedy, hf_greedy, tiny


def test_a_dynamic_rope_threshold_below_the_check_runs_under_tp():
    from transformers import LlamaConfig
    model = tiny(LlamaConfig, vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    want = hf_greedy(model, PROMPTS)
    assert engine_greedy(model, PROMPTS, max_context=32, tensor_parallel_size=2) == want
