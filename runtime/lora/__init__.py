"""Multi-LoRA serving, the model side: PEFT LoRA adapters read and checked against a model
(``LoraAdapter``), laid out flat in memory the caller provides (pool pages), and applied per
token row inside the HF model's own forward (``attach_lora``, ``LoraBatch``).

    adapter = LoraAdapter.load("path/to/adapter", model)    # refuses what it cannot run, by name
    adapter.pack_into(buffer)                                # buffer: >= adapter.num_bytes uint8
    weights = adapter.views(buffer)                          # zero-copy
    slots = attach_lora(model)
    with slots.batch(LoraBatch([(0, 7, weights), (7, 12, None)])):
        logits = model(input_ids=ids).logits
"""
from .adapter import WEIGHTS_FILE, LoraAdapter
from .config import CONFIG_FILE, AdapterConfig
from .errors import (LoraBatchError, LoraBufferError, LoraConfigError, LoraError, LoraMemoryError,
                     LoraTargetError, LoraWeightsError)
from .layers import PROJECTIONS, LoraBatch, LoraSlots, attach_lora, supported_modules
from .weights import ALIGN_BYTES, AdapterWeights, ModuleLora

__all__ = [
    "LoraAdapter", "AdapterConfig", "AdapterWeights", "ModuleLora", "LoraBatch", "LoraSlots",
    "attach_lora", "supported_modules", "PROJECTIONS", "ALIGN_BYTES", "CONFIG_FILE", "WEIGHTS_FILE",
    "LoraError", "LoraConfigError", "LoraWeightsError", "LoraTargetError", "LoraBufferError",
    "LoraBatchError", "LoraMemoryError",
]
