"""Random PEFT adapters for the LoRA tests: saved by peft itself (B not zero), and PEFT's merged
model as the reference."""
from __future__ import annotations

import copy

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def save_adapter(model, directory, *, seed: int, r: int = 4, lora_alpha: float = 8,
                 target_modules=ATTENTION, **fields) -> str:
    """Save a random LoRA of ``model`` (weights drawn from ``seed``) with peft; its path."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                        init_lora_weights=False, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(model), config)
    peft_model.save_pretrained(str(directory))
    return str(directory)


def merged_model(model, path: str):
    """PEFT's own reading of the adapter at ``path``, merged into a copy of ``model``."""
    from peft import PeftModel
    return PeftModel.from_pretrained(copy.deepcopy(model), path).merge_and_unload().eval()
