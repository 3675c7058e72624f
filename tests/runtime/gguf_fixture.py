"""A small GGUF file written from tiny-llama's random weights, as llama.cpp's converter lays them
out (q and k rows permuted per head, which transformers undoes), with a byte-level tokenizer of
256 tokens: a GGUF transformers converts in about a second, whose every weight is known.

    write_tiny_gguf(path)                               # every tensor, lm_head its own
    write_tiny_gguf(path, skip={"blk.1.ffn_norm.weight"})   # one tensor left out
    write_tiny_gguf(path, tied=True)                    # no output.weight: lm_head tied
    write_tiny_gguf(path, extra={"rope_freqs.weight": a})   # a tensor the model has no place for
"""
from __future__ import annotations

import numpy as np

from vmemkv.runtime.models import build_model

LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of transformers tensor ``hf_name`` (model.layers.1.mlp.up_proj.weight ->
    blk.1.ffn_up.weight)."""
    module = hf_name.removesuffix(".weight")
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{LAYER_NAMES[rest]}.weight"
    return f"{TOP_NAMES[module]}.weight"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's rotary layout: (heads, 2, dim/2, in) -> (heads, dim/2, 2, in)
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, 2, rows, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens() -> list:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return list(bytes_to_unicode().values())


def write_tiny_gguf(path, skip=(), tied: bool = False, extra=None):
    """Write tiny-llama (seed 0) to ``path`` as an F32 GGUF; returns the model written."""
    import gguf
    model = build_model("tiny-llama")
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([1] * c.vocab_size)
    writer.add_token_scores([0.0] * c.vocab_size)
    writer.add_eos_token_id(0)
    for hf_name, tensor in model.state_dict().items():
        name = gguf_name(hf_name)
        if name in skip or (tied and name == "output.weight"):
            continue
        w = tensor.numpy()
        if name.endswith("attn_q.weight"):
            w = _permute(w, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = _permute(w, c.num_key_value_heads)
        writer.add_tensor(name, np.ascontiguousarray(w))
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
