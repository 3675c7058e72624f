"""Non-finite or huge V for one request of a batch, triggered by a poison token in its prompt.

    model = build_model("tiny-llama", seed=0)
    poison_v(model, {POISON: (VFault(layer=0, factor=300.0), VFault(layer=1, factor=NAN))})
    engine.generate([[1, 2, POISON], [5, 6]], ...)   # the first request's V: 300x, then NaN

What a model overflowing does: the rows of the poison token's V (the attention's v_proj output)
in the given layers are multiplied by ``factor`` (NaN: NaN, inf: +-inf, 300.0: huge and
finite), in the given KV heads only when ``kv_heads`` is set; every other token's K/V are the
model's own, bit for bit. An 8-bit KV cache refuses a LoRA adapter on V (runtime/engine/
adapters.py), so these hooks replace the adapters that tests used to inject such V with.

The hooks are picklable objects on modules tensor parallelism keeps (``embed_tokens`` and each
layer's ``self_attn``: they travel to every rank with the model), and each layer's hook hooks
that layer's current ``v_proj`` on its first forward, so a rank's shard (whose v_proj is a new
Linear holding its KV heads only: runtime/distributed/sharding.py) is hooked too; a shard's
rows are its own KV heads' (``kv_head_span``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from vmemkv.runtime.distributed.sharding import kv_head_span

NAN = float("nan")
INF = float("inf")
# tiny-llama token ids (with POISON - 1, POISON - 2) outside the engine's self-check prompt
# (runtime/engine/self_check.py: (7 i + 3) % 256 holds 255) and these tests' other prompts; a
# model that generated one would fail its request loudly, never pass a test silently
POISON = 254


@dataclass(frozen=True)
class VFault:
    """The poison token's V in ``layer`` multiplied by ``factor``, in ``kv_heads`` (None: all)."""
    layer: int
    factor: float
    kv_heads: Optional[Tuple[int, ...]] = None


class _TokenIds:
    """Forward pre-hook on ``embed_tokens``: keeps the forward's input ids for the layers."""

    def __init__(self) -> None:
        self.ids: Optional[torch.Tensor] = None     # [batch, tokens]

    def __call__(self, embed, args) -> None:
        self.ids = args[0]


class _LayerVFaults:
    """Forward pre-hook on one layer's ``self_attn``: hooks its current ``v_proj`` (once per
    Linear) with ``corrupt``, which applies the layer's faults to the poison tokens' rows."""

    def __init__(self, token_ids: _TokenIds, faults: Dict[int, Sequence[VFault]], config) -> None:
        self.token_ids, self.faults, self.config = token_ids, faults, config
        self.hooked = None           # the v_proj Linear hooked last
        text = config.get_text_config()
        self.kv_heads = text.num_key_value_heads
        self.head_dim = text.head_dim

    def __call__(self, attn, args) -> None:
        if self.hooked is not attn.v_proj:
            attn.v_proj.register_forward_hook(self.corrupt)
            self.hooked = attn.v_proj

    def _heads_here(self, width: int) -> range:
        """The global KV heads of a v_proj output ``width`` wide: all of them, or a rank's."""
        if width == self.kv_heads * self.head_dim:
            return range(self.kv_heads)
        span = kv_head_span(self.config, dist.get_rank(), dist.get_world_size())
        return range(span.start, span.stop)

    def corrupt(self, linear, args, v: torch.Tensor) -> torch.Tensor:
        heads = self._heads_here(v.shape[-1])
        v = v.clone().unflatten(-1, (len(heads), self.head_dim))   # [batch, tokens, heads, dim]
        for token, faults in self.faults.items():
            rows = self.token_ids.ids == token
            for fault in faults:
                for local, head in enumerate(heads):
                    if fault.kv_heads is None or head in fault.kv_heads:
                        v[..., local, :][rows] *= fault.factor
        return v.flatten(-2)


def poison_v(model, faults: Dict[int, Sequence[VFault]]):
    """``model`` (a Llama-style decoder) with V faults per poison token id (see the module
    docstring); returns it."""
    token_ids = _TokenIds()
    model.get_input_embeddings().register_forward_pre_hook(token_ids)
    layers = sorted({f.layer for fs in faults.values() for f in fs})
    for layer in layers:
        of_layer = {token: [f for f in fs if f.layer == layer] for token, fs in faults.items()}
        model.model.layers[layer].self_attn.register_forward_pre_hook(
            _LayerVFaults(token_ids, of_layer, model.config))
    return model
