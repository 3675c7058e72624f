"""A PEFT LoRA adapter read from disk and checked against one model.

On disk (what ``PeftModel.save_pretrained`` writes): ``adapter_config.json`` and
``adapter_model.safetensors`` with, per targeted module, two tensors named

    base_model.model.<module>.lora_A.weight    [r, in_features]
    base_model.model.<module>.lora_B.weight    [out_features, r]

where ``<module>`` names an ``nn.Linear`` of the model (``model.layers.0.self_attn.q_proj``).
Everything we would compute differently from PEFT is refused by name before a byte is used.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .config import AdapterConfig, read_config
from .errors import (LoraBufferError, LoraConfigError, LoraMemoryError, LoraTargetError,
                     LoraWeightsError)
from .layers import KV_PROJECTIONS, PROJECTIONS, supported_modules
from .weights import AdapterWeights, FlatLayout, ModuleLora

WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILE = "adapter_model.bin"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")
# any tensor PEFT keeps for a module it adapts: lora_* (A, B, embedding A/B, DoRA's magnitude, ..)
# and, with save_embedding_layers, the module's base_layer weight
_MODULE_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.(?:lora_|base_layer\.)")

Pair = Tuple[torch.Tensor, torch.Tensor]   # (A [r, in], B [out, r]) as stored in the file
Cut = Tuple[Optional[slice], Optional[slice]]   # (B's rows, A's columns) one rank keeps


class LoraAdapter:
    """An adapter checked against one model: its scale per module, its content ``digest``, and
    its weights laid out flat in the modules' dtypes (``num_bytes``; a host image that
    ``pack_into`` copies in one go; ``views``). Build with ``LoraAdapter.load``."""

    def __init__(self, path: str, config: AdapterConfig, pairs: Mapping[str, Pair],
                 layout: FlatLayout, digest: Optional[str] = None) -> None:
        self.path = path
        self.config = config
        self.layout = layout
        self.scales = {module: config.scale_of(module) for module in sorted(pairs)}
        self.digest = digest or _digest(config, pairs)
        self._image = torch.zeros(layout.num_bytes, dtype=torch.uint8)   # padding stays zero
        for module, (a, b) in pairs.items():
            a_slot, b_slot = layout.slots[module]
            a_slot.view(self._image).copy_(a)          # cast to the module's dtype, once
            b_slot.view(self._image).copy_(b)

    @classmethod
    def load(cls, path, model: nn.Module, host_copies: int = 1) -> "LoraAdapter":
        """Read the adapter at directory ``path`` for ``model``; raise a ``LoraError`` subclass
        naming the path and the field, tensor or module at fault, and ``LoraMemoryError`` before
        reading the weights when ``host_copies`` copies of them (one per process that will hold
        them) would exceed the host's available memory."""
        path = _directory_name(path)
        if not os.path.isdir(path):
            raise LoraConfigError(f"LoRA adapter {path!r}: not a directory")
        config = read_config(path)
        _check_host_memory(path, model, host_copies)
        tensors = _read_tensors(path)
        targets = supported_modules(model)
        # every module the file names, its base_layer copies too, is checked as a target first:
        # an embedding or lm_head target is refused as such, not by its first odd tensor
        found = {module: _target(path, model, module, targets) for module in _modules(tensors)}
        pairs = _pairs(path, tensors)
        _check_selected(path, config, pairs)
        shapes = {}
        for module, (a, b) in pairs.items():
            weight = found[module].weight                               # [out, in]
            _check_shapes(path, module, a, b, tuple(weight.shape), config.rank_of(module))
            shapes[module] = (tuple(a.shape), tuple(b.shape), weight.dtype)
        adapter = cls(path, config, pairs, FlatLayout.plan(shapes))
        adapter._check_finite()
        return adapter

    def _check_finite(self) -> None:
        """LoraWeightsError naming the first A or B that holds NaN or inf in its module's
        dtype (in the file, or past the dtype's range: 1e5 in fp16): it would reach the logits
        of every request on the adapter, failing each."""
        for module, lora in self.views(self._image).modules.items():
            for part, tensor in (("lora_A", lora.a), ("lora_B", lora.b)):
                bad = tensor.numel() - int(torch.isfinite(tensor).sum())
                if bad:
                    raise LoraWeightsError(
                        f"LoRA adapter {self.path!r}: {module}.{part} holds {bad} NaN or "
                        f"infinite values (of {tensor.numel()}) in the model's {tensor.dtype}")

    @property
    def modules(self) -> Tuple[str, ...]:
        """The modules the adapter targets, sorted."""
        return tuple(self.scales)

    @property
    def kv_modules(self) -> Tuple[str, ...]:
        """The modules it targets whose outputs are K or V (``k_proj``, ``v_proj``, a fused
        ``qkv_proj``), sorted: an 8-bit KV cache's scales, fixed for the base model, do not
        cover what they write (runtime/engine/adapters.py refuses them there)."""
        return tuple(m for m in self.modules if m.rsplit(".", 1)[-1] in KV_PROJECTIONS)

    @property
    def num_bytes(self) -> int:
        """Bytes its A and B weights take in their modules' dtypes, 64-byte padding included."""
        return self.layout.num_bytes

    def pack_into(self, buffer: torch.Tensor) -> None:
        """Write every A and B, cast to its module's dtype, into ``buffer`` (1-D uint8, at
        least ``num_bytes``, 64-byte aligned; any device)."""
        self.layout.check(buffer, f"LoRA adapter {self.path!r}")
        if self._image is None:
            raise LoraBufferError(f"LoRA adapter {self.path!r}: this copy holds no host image to "
                                  f"pack (without_image); pack the adapter it came from")
        buffer[:self.num_bytes].copy_(self._image)

    def views(self, buffer: torch.Tensor) -> AdapterWeights:
        """The weights ``pack_into`` wrote, as zero-copy views of ``buffer``."""
        self.layout.check(buffer, f"LoRA adapter {self.path!r}")
        modules = {module: ModuleLora(a_slot.view(buffer), b_slot.view(buffer), self.scales[module])
                   for module, (a_slot, b_slot) in self.layout.slots.items()}
        return AdapterWeights(digest=self.digest, modules=modules)

    def sliced(self, cuts: Mapping[str, Cut]) -> "LoraAdapter":
        """This adapter as one tensor-parallel rank holds it: per module in ``cuts``, B's rows
        ``out_rows`` (a column-parallel shard's outputs) and A's columns ``in_cols`` (a
        row-parallel shard's inputs), either None for whole; same digest, scales and path.
        Itself when no module it targets is cut."""
        if not any(cuts.get(module, (None, None)) != (None, None) for module in self.modules):
            return self
        whole = self.views(self._image)
        pairs, shapes = {}, {}
        for module, lora in whole.modules.items():
            out_rows, in_cols = cuts.get(module, (None, None))
            a = lora.a if in_cols is None else lora.a[:, in_cols]
            b = lora.b if out_rows is None else lora.b[out_rows]
            pairs[module] = (a, b)
            shapes[module] = (tuple(a.shape), tuple(b.shape), a.dtype)
        return LoraAdapter(self.path, self.config, pairs, FlatLayout.plan(shapes), self.digest)

    def without_image(self) -> "LoraAdapter":
        """This adapter without its host image: it still gives ``views`` of a buffer packed
        already (a rank's slice, once in its pool pages), and holds no weights of its own."""
        lean = copy.copy(self)
        lean._image = None
        return lean

    def materialize(self, device="cpu") -> AdapterWeights:
        """The weights in a buffer of their own on ``device`` (for callers without pool pages)."""
        buffer = torch.empty(self.num_bytes, dtype=torch.uint8, device=device)
        self.pack_into(buffer)
        return self.views(buffer)


def _directory_name(path) -> str:
    """``path`` as a str, or LoraConfigError naming what it is (bytes or 3 were a TypeError)."""
    name = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(name, str):
        raise LoraConfigError(f"LoRA adapter path must be its directory as a str or "
                              f"os.PathLike of a str, got {type(path).__name__} "
                              f"{repr(path)[:60]}")
    return name


def _check_host_memory(path: str, model: nn.Module, host_copies: int) -> None:
    """LoraMemoryError when ``host_copies`` x (the file's tensors as read + their flat copy in
    the model's widest float dtype) exceeds the host's MemAvailable; the sizes come from the
    safetensors header alone. A file that cannot be read is left to ``_read_tensors``."""
    from safetensors import safe_open

    from vmemkv.runtime import memory
    file = os.path.join(path, WEIGHTS_FILE)
    try:
        with safe_open(file, framework="pt") as weights:
            numel = sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
        file_bytes = os.path.getsize(file)
    except Exception:   # noqa: BLE001 - missing or malformed: _read_tensors says which
        return
    itemsize = max((p.dtype.itemsize for p in model.parameters() if p.is_floating_point()),
                   default=4)
    need_bytes = host_copies * (file_bytes + numel * itemsize)
    # what KV pools in this process promised and have not created yet is not available
    available = memory.unpromised_available_bytes(torch.device("cpu"))
    if available is not None and need_bytes > available:
        copies = f" x {host_copies} processes" if host_copies > 1 else ""
        raise LoraMemoryError(f"LoRA adapter {path!r}: loading it needs {need_bytes} bytes of "
                              f"host memory ({file_bytes} read + {numel * itemsize} in the "
                              f"model's dtype{copies}), more than the {available} bytes "
                              f"available (host MemAvailable less what KV pools in this "
                              f"process promised and have not created yet)")


def _read_tensors(path: str) -> Dict[str, torch.Tensor]:
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        if os.path.exists(os.path.join(path, _PICKLE_FILE)):
            raise LoraWeightsError(f"LoRA adapter {path!r}: {_PICKLE_FILE} is refused (a pickle "
                                   f"can run code); save the adapter as {WEIGHTS_FILE} "
                                   "(save_pretrained(..., safe_serialization=True))")
        raise LoraWeightsError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}")
    from safetensors.torch import load_file
    try:
        return load_file(file, device="cpu")
    except Exception as error:   # safetensors raises its own SafetensorError, OSError, ...
        raise LoraWeightsError(f"LoRA adapter {path!r}: cannot read {WEIGHTS_FILE}: "
                               f"{error}") from error


def _modules(tensors: Mapping[str, torch.Tensor]) -> List[str]:
    """The modules the file's keys adapt, sorted (keys of no module are left to ``_pairs``)."""
    return sorted({match["module"] for match in map(_MODULE_KEY.match, tensors) if match})


def _pairs(path: str, tensors: Mapping[str, torch.Tensor]) -> Dict[str, Pair]:
    """``{module: (A, B)}`` from the file's keys; anything but LoRA A/B weights refused."""
    parts: Dict[str, Dict[str, Tuple[str, torch.Tensor]]] = {}   # module -> part -> (key, .)
    for key in sorted(tensors):
        match = _KEY.match(key)
        if match is None:
            raise LoraWeightsError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds {key!r}, not a "
                                   "LoRA weight (<module>.lora_A.weight / <module>.lora_B.weight)")
        tensor = tensors[key]
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise LoraWeightsError(f"LoRA adapter {path!r}: {key!r} is {tensor.dtype} of shape "
                                   f"{tuple(tensor.shape)}, not a 2-D floating-point matrix")
        found = parts.setdefault(match["module"], {})
        if match["part"] in found:   # with and without base_model.model.: which is meant?
            raise LoraWeightsError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds "
                                   f"{match['module']}.{match['part']} twice (under "
                                   f"{found[match['part']][0]!r} and {key!r})")
        found[match["part"]] = (key, tensor)
    if not parts:
        raise LoraWeightsError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, found in parts.items():
        for part in ("lora_A", "lora_B"):
            if part not in found:
                raise LoraWeightsError(f"LoRA adapter {path!r}: module {module!r} has no "
                                       f"{part} weight")
    return {module: (found["lora_A"][1], found["lora_B"][1]) for module, found in parts.items()}


def _check_selected(path: str, config: AdapterConfig, modules) -> None:
    """LoraConfigError unless the config selects every module the file holds weights for:
    PEFT applies only those (it leaves a file's others unused, with a warning)."""
    if config.target_modules is None:
        raise LoraConfigError(f"LoRA adapter {path!r}: target_modules is not set; PEFT would "
                              "adapt its default modules for the model type and leave the "
                              "file's others unused: list the adapted modules in target_modules")
    unselected = sorted(module for module in modules if not config.selects(module))
    if unselected:
        excluded = f", exclude_modules={config.exclude_modules!r}" if config.exclude_modules else ""
        raise LoraConfigError(
            f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds weights of {len(unselected)} "
            f"module(s) the config does not select ({', '.join(unselected[:4])}"
            f"{', ...' if len(unselected) > 4 else ''}; "
            f"target_modules={config.target_modules!r}{excluded}): PEFT leaves them unused; "
            "remove them from the file or select them in target_modules")


def _target(path: str, model: nn.Module, module: str, targets) -> nn.Linear:
    if module in targets:
        return model.get_submodule(module)
    try:
        found = model.get_submodule(module)
    except AttributeError:
        raise LoraTargetError(f"LoRA adapter {path!r}: target_modules includes {module!r}, which "
                              "the model does not have (an adapter for another model?)") from None
    output_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(found, nn.Embedding):
        what = "the embeddings"
    elif found is output_head:
        what = "the output head (lm_head)"
    else:
        what = f"a {type(found).__name__}"
    raise LoraTargetError(f"LoRA adapter {path!r}: target_modules includes {module!r}, {what}; "
                          "only the decoder layers' nn.Linear projections are adapted "
                          f"({', '.join(sorted(PROJECTIONS))})")


def _check_shapes(path: str, module: str, a: torch.Tensor, b: torch.Tensor,
                  weight_shape: Tuple[int, int], rank: int) -> None:
    out_features, in_features = weight_shape
    r = a.shape[0]
    if b.shape[1] != r:
        raise LoraWeightsError(f"LoRA adapter {path!r}: {module}.lora_A has rank {r} (shape "
                               f"{tuple(a.shape)}), lora_B rank {b.shape[1]} "
                               f"(shape {tuple(b.shape)})")
    for part, got, expected in (("lora_A", tuple(a.shape), (r, in_features)),
                                ("lora_B", tuple(b.shape), (out_features, r))):
        if got != expected:
            raise LoraTargetError(f"LoRA adapter {path!r}: {module}.{part} has shape {got}, the "
                                  f"model's module needs {expected} (weight {weight_shape})")
    if r != rank:
        raise LoraWeightsError(f"LoRA adapter {path!r}: {module} has rank {r}, the config "
                               f"(r / rank_pattern) gives r={rank}")


def _digest(config: AdapterConfig, pairs: Mapping[str, Pair]) -> str:
    """SHA-256 over the math (rank, alpha, rsLoRA per module) and every weight's name, dtype,
    shape and bytes, in sorted order: the same content gives the same digest, whatever the path."""
    sha = hashlib.sha256()
    math_fields = {"use_rslora": config.use_rslora,
                   "modules": {module: {"r": config.rank_of(module),
                                        "alpha": float(config.alpha_of(module))}
                               for module in sorted(pairs)}}
    sha.update(json.dumps(math_fields, sort_keys=True, separators=(",", ":")).encode())
    for module in sorted(pairs):
        for part, tensor in zip(("lora_A", "lora_B"), pairs[module]):
            header = [f"{module}.{part}", str(tensor.dtype), list(tensor.shape)]
            sha.update(json.dumps(header).encode())
            sha.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return sha.hexdigest()
