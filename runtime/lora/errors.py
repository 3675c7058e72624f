"""Typed errors of LoRA serving: each a user error (a ValueError under the runtime's base), its
message naming the adapter path and the offending field, module or value."""
from __future__ import annotations

from ..errors import RuntimeKVError


class LoraError(RuntimeKVError, ValueError):
    """Base class of the LoRA errors."""


class LoraConfigError(LoraError):
    """adapter_config.json is missing, unreadable, or sets a field we do not run (DoRA,
    modules_to_save, a LoRA bias, ...); the message names the field."""


class LoraWeightsError(LoraError):
    """The weight file is missing or not safetensors, or holds a tensor that is not a LoRA A/B
    weight, or a module lacks its A or B, or a rank disagrees with the config."""


class LoraTargetError(LoraError):
    """The adapter targets a module the model lacks, one that is not a decoder projection
    (embeddings, lm_head, ...), or one whose shape differs from the adapter's."""


class LoraMemoryError(LoraError, MemoryError):
    """Loading the adapter would take more host memory than is available (``MemAvailable``):
    the file's tensors and their copy in the model's dtype, once per process that holds the
    adapter (every tensor-parallel rank). Raised before a byte of the weights is read."""


class LoraBufferError(LoraError):
    """A buffer handed to ``pack_into``/``views`` is not a 1-D uint8 tensor, aligned to 64
    bytes, of at least the adapter's ``num_bytes``."""


class LoraBatchError(LoraError):
    """A step's LoRA segments overlap, are out of range, or name modules the model lacks."""
