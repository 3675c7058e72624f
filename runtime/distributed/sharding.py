"""Megatron-style sharding of an HF decoder by attention heads and MLP columns.

Per decoder layer, for ``world`` ranks (rank r):

    q_proj, k_proj, v_proj   column-parallel: rank r keeps its heads' output rows (and biases)
    o_proj                   row-parallel: rank r keeps its heads' input columns; outputs are
                             summed over ranks (all_reduce), the bias added once after the sum
    gate_proj, up_proj       column-parallel: intermediate columns [r*I/N, (r+1)*I/N)
    down_proj                row-parallel (all_reduce)
    embeddings, norms, lm_head   replicated (every rank computes the full logits)

KV heads: with ``kv_heads % world == 0`` rank r keeps ``kv_heads / world`` of them; with fewer KV
heads than ranks (``world % kv_heads == 0``) each KV head is replicated on ``world / kv_heads``
ranks (as vLLM does), rank r keeping KV head ``r // (world / kv_heads)``. Query heads are always
split evenly, so every rank keeps the model's grouped-query ratio or a divisor of it.

These are our own wrappers: transformers' ``tp_plan`` shards through DTensor at
``from_pretrained`` time and does not apply to a model a user already built (docs/usage.md).
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from vmemkv.runtime.engine.errors import TensorParallelConfigError

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_heads_per_rank(config, world: int) -> int:
    """KV heads each rank's cache holds (``kv_heads / world``, or 1 when KV heads are replicated)."""
    text = _text(config)
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return max(1, kv // world)


def kv_head_span(config, rank: int, world: int) -> slice:
    """The KV heads (indices) rank ``rank`` of ``world`` holds: its ``kv_heads / world`` of
    them, or the one it replicates when ``world`` exceeds the KV heads."""
    text = _text(config)
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if world > kv:
        head = rank // (world // kv)
        return slice(head, head + 1)
    return slice(rank * (kv // world), (rank + 1) * (kv // world))


def rank_kv_scales(scales, config, rank: int, world: int):
    """Rank ``rank``'s columns of 8-bit ``scales`` (a KVScales over every KV head, None
    passes): the scales of the KV heads its cache holds (``kv_head_span``)."""
    if scales is None:
        return None
    from vmemkv.runtime.kv_dtype import KVScales
    heads = kv_head_span(config, rank, world)
    return KVScales(tuple(row[heads] for row in scales.k), tuple(row[heads] for row in scales.v))


def check_tensor_parallel(model, world) -> None:
    """Refuse, before any process starts, a ``world`` this model cannot be sharded into exactly,
    naming the value and the limit (TensorParallelConfigError)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise TensorParallelConfigError(f"tensor_parallel_size must be an int >= 1, got {world!r}")
    if world == 1:
        return
    text = _text(model.config)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    width = getattr(text, "intermediate_size", None)
    if world > heads:
        raise TensorParallelConfigError(f"tensor_parallel_size {world} exceeds the model's "
                                        f"{heads} attention heads")
    if heads % world:
        raise TensorParallelConfigError(f"tensor_parallel_size {world} does not divide the "
                                        f"model's {heads} attention heads")
    if kv % world and world % kv:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {world} neither divides the model's {kv} KV heads nor is a "
            f"multiple of them (needed to split or replicate KV heads exactly)")
    if width is None or width % world:
        raise TensorParallelConfigError(f"tensor_parallel_size {world} does not divide the "
                                        f"model's MLP width (intermediate_size={width})")
    for index, layer in enumerate(_decoder_layers(model)):
        missing = [n for n in ATTENTION_PROJECTIONS if not isinstance(
            getattr(layer.self_attn, n, None), torch.nn.Linear)]
        missing += [n for n in MLP_PROJECTIONS if not isinstance(
            getattr(getattr(layer, "mlp", None), n, None), torch.nn.Linear)]
        if missing:
            raise TensorParallelConfigError(
                f"{getattr(text, 'model_type', type(model).__name__)} layer {index} has no "
                f"{', '.join(missing)} Linear; tensor parallelism shards Llama-style decoders "
                f"(q/k/v/o_proj, gate/up/down_proj) only")


def _decoder_layers(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TensorParallelConfigError(f"{type(model).__name__} has no .model.layers; tensor "
                                        f"parallelism shards Llama-style decoders only")
    return layers


class RowParallelLinear(torch.nn.Module):
    """``x @ W[:, cols].T`` summed over ranks by ``all_reduce``, then the bias (added once).
    ``partial_linear`` computes this rank's partial sum: a LoRA hook there adds the adapter's
    share of the same input columns (``lora_in_cols``) before the sum (runtime/lora/layers.py)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 all_reduce: Callable[[torch.Tensor], None], cols: slice) -> None:
        super().__init__()
        self.partial_linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                              device="meta")
        self.partial_linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.partial_linear.lora_in_cols = cols
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self._all_reduce = all_reduce

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.partial_linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial_linear(x)
        self._all_reduce(y)
        return y if self.bias is None else y + self.bias


def _take(tensor: torch.Tensor, index, device) -> torch.Tensor:
    """A contiguous copy of ``tensor[index]`` on ``device`` (None: where it is), copied once."""
    return tensor.detach()[index].to(device=device or tensor.device, copy=True,
                                      memory_format=torch.contiguous_format)


def _column(linear: torch.nn.Linear, rows: slice, device) -> torch.nn.Linear:
    out = torch.nn.Linear(linear.in_features, rows.stop - rows.start, bias=linear.bias is not None,
                          device="meta")
    out.weight = torch.nn.Parameter(_take(linear.weight, rows, device), requires_grad=False)
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(_take(linear.bias, rows, device), requires_grad=False)
    out.lora_out_rows = rows     # a LoRA hook adds its B's rows of this rank's outputs
    return out


def _row(linear: torch.nn.Linear, cols: slice, all_reduce, device) -> RowParallelLinear:
    bias = None if linear.bias is None else _take(linear.bias, slice(None), device)
    return RowParallelLinear(_take(linear.weight, (slice(None), cols), device), bias, all_reduce,
                             cols)


def shard_model(model, rank: int, world: int, all_reduce: Callable[[torch.Tensor], None],
                copy_first: bool = True, device: Optional[torch.device] = None):
    """Rank ``rank``'s shard of ``model`` (see the module docstring), on ``device`` (None: where
    the model is). ``copy_first`` leaves the given model untouched: the shard is a copy whose
    replicated parameters are the original's (shared, not copied, when ``device`` is the
    model's) and whose sharded projections hold only this rank's slices, each copied once
    straight to ``device``."""
    check_tensor_parallel(model, world)
    if copy_first:
        memo = {id(p): p for p in model.parameters()}
        model = copy.deepcopy(model, memo)
    text = _text(model.config)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    q = _span(rank, heads // world, head_dim)
    kv_heads = kv_head_span(model.config, rank, world)
    kv_span = slice(kv_heads.start * head_dim, kv_heads.stop * head_dim)
    width = text.intermediate_size // world
    mlp = slice(rank * width, (rank + 1) * width)
    for layer in _decoder_layers(model):
        attn = layer.self_attn
        attn.q_proj = _column(attn.q_proj, q, device)
        attn.k_proj = _column(attn.k_proj, kv_span, device)
        attn.v_proj = _column(attn.v_proj, kv_span, device)
        attn.o_proj = _row(attn.o_proj, q, all_reduce, device)
        attn.num_key_value_groups = (heads // world) // max(1, kv // world)
        layer.mlp.gate_proj = _column(layer.mlp.gate_proj, mlp, device)
        layer.mlp.up_proj = _column(layer.mlp.up_proj, mlp, device)
        layer.mlp.down_proj = _row(layer.mlp.down_proj, mlp, all_reduce, device)
    return model if device is None else model.to(device)   # the replicated rest, too


def _span(index: int, heads: int, head_dim: int) -> slice:
    return slice(index * heads * head_dim, (index + 1) * heads * head_dim)
