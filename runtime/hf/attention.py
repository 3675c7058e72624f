"""The ``"vmemkv"`` attention function for transformers' ``AttentionInterface``.

One packed step, driven by the engine's ModelRunner (HF model code runs unmodified):

    model(input_ids [1, T], position_ids [1, T], use_cache=False,
          vmemkv_step=StepContext(cache, backend))
      each attention layer: q/k/v projections and RoPE (HF code), then
      vmemkv_attention(module, query [1, H, T, D], key [1, Hkv, T, D], value, mask=None, ...)
          cache.write(layer, k [T, Hkv, D], v)           # the new tokens' K/V, already RoPE'd
          out = backend.forward(q [T, H, D], cache.layer_view(layer), scaling, softcap)
          return out [1, T, H, D], None                   # HF reshapes to [1, T, H*D] for o_proj

The T tokens are several sequences packed back to back (prefill chunks and decodes mixed); the
cache's ``begin_step`` says which token is whose and where it goes. No HF mask is built: this
name is not in transformers' mask registry, so ``create_causal_mask`` returns None; causality and
sequence boundaries are the backend's job. ``vmemkv_step`` reaches us through the ``**kwargs``
HF forwards from ``model(...)`` down to every attention call.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import RuntimeKVError

ATTN_IMPLEMENTATION = "vmemkv"
STEP_KWARG = "vmemkv_step"


class UnsupportedModelError(RuntimeKVError, ValueError):
    """The model needs a feature the vmemkv path does not implement (sinks, ALiBi, chunked or
    bidirectional attention, linear-attention layers, a non-causal layer, no AttentionInterface,
    a layer whose sliding window differs from the one its cache was built for), or failed the
    engine's self-check; raised before anything is built."""


@dataclass(frozen=True)
class StepContext:
    """What the attention function needs for one step: the cache (``begin_step`` already called)
    and the attention backend that reads it; ``max_context_tokens``: the longest sequence the
    caller runs (the engine's ``max_context``: a window at least that long cuts nothing), None:
    the cache's ``max_context``."""
    cache: Any      # runtime.cache.KVCache
    backend: Any    # runtime.attention.AttentionBackend
    max_context_tokens: Optional[int] = None


def vmemkv_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     scaling: Optional[float] = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Write this step's K/V of layer ``module.layer_idx`` into the cache, attend over it.

    query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` -> ``([1, T, H, D], None)``.
    """
    ctx: Optional[StepContext] = kwargs.get(STEP_KWARG)
    if ctx is None:
        raise UnsupportedModelError(
            f"attn_implementation {ATTN_IMPLEMENTATION!r} needs {STEP_KWARG}=StepContext(...) in "
            f"the model call; run the model through vmemkv.runtime.engine (or pass it yourself)")
    _check_supported(module, query, ctx, kwargs)
    layer = module.layer_idx
    ctx.cache.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))  # (T, Hkv, D)
    q = query[0].transpose(0, 1)                                              # (T, H, D)
    out = ctx.backend.forward(q, ctx.cache.layer_view(layer), scaling,
                              softcap=kwargs.get("softcap"))                  # (T, H, D)
    return out.unsqueeze(0), None


def _check_supported(module, query: torch.Tensor, ctx: StepContext, kwargs: dict) -> None:
    if query.shape[0] != 1:
        raise UnsupportedModelError(f"vmemkv attention runs packed batches [1, tokens, ...]; "
                                    f"got a batch of {query.shape[0]}")
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(f"layer {module.layer_idx} passes attention sinks (s_aux); "
                                    f"vmemkv attention does not implement them")
    window = kwargs.get("sliding_window")
    built = ctx.cache.config.window_of(module.layer_idx)
    longest = ctx.max_context_tokens or ctx.cache.config.max_context
    # a window no shorter than any sequence cuts nothing: a layer only the mask windows
    # (support._check_mask_only_window) passes none, and attends as its cache reads
    cuts_nothing = window is None and built is not None and built >= longest
    if window != built and not cuts_nothing:   # the cache reads (and frees) by its own windows
        raise UnsupportedModelError(
            f"layer {module.layer_idx} attends with a sliding window of {window} tokens but its "
            f"cache was built for {built} (CacheConfig.layer_windows, from the model config by "
            f"runtime.hf.support.layer_windows_of)")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"layer {module.layer_idx} is not causal")


def register_attention() -> str:
    """Register ``vmemkv_attention`` under ``"vmemkv"`` (idempotent); returns the name."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, vmemkv_attention)
    return ATTN_IMPLEMENTATION


def use_vmemkv_attention(model) -> None:
    """Switch an HF model (every submodule) to the vmemkv attention function (under its
    ``model_lock``)."""
    register_attention()
    with model_lock(model):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


# model -> [engines holding it on our attention, the implementation it had before the first,
#           {id(engine): its finalizer}, the handle of the forward pre-hook, its .training]
_HOLDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# model -> the RLock that serializes its forwards with switches of its attention implementation
_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
# (weakref to a model, id of an engine collected without close()): releases still to apply. The
# collector may run a finalizer anywhere, even inside a forward of this model on our attention,
# so a finalizer only queues; the queue is applied by the next hold, release or switch, and by a
# forward of the model that is not a vmemkv step (_release_dropped_engines).
_RELEASE_LATER: list = []


def model_lock(model) -> "threading.RLock":
    """The reentrant lock of ``model`` (one per model object). The attention implementation is
    model-wide state read by every layer of every forward, so whoever switches it (an engine's
    self-check, kv-scale calibration, the last engine's close) holds this lock for the switch
    and its forward, and each engine's ModelRunner holds it for each forward: a forward never
    sees another thread's switch half-way (it would skip the KV cache)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def hold_vmemkv_attention(model, engine) -> str:
    """Count ``engine`` as one more running ``model`` on our attention; returns the model's own
    implementation (the one it had before the first engine holding it), which the last
    ``release_vmemkv_attention`` restores, with its train or eval mode. Reading it and counting are one step under the
    model's ``model_lock``: read apart, an engine built while another closed read "vmemkv" (the
    other's) as the model's own and left the model on it for good. An engine collected without
    releasing is released later (a finalizer that only queues): the model is not left on our
    attention for good by an engine dropped without ``close()``."""
    _apply_later_releases()
    with model_lock(model):
        entry = _HOLDERS.get(model)
        if entry is None:
            hook = model.register_forward_pre_hook(_release_dropped_engines, with_kwargs=True)
            entry = _HOLDERS[model] = [0, model.config._attn_implementation, {}, hook,
                                       model.training]   # the engine runs it in eval mode
        finalizer = weakref.finalize(engine, _RELEASE_LATER.append, (weakref.ref(model), id(engine)))
        finalizer.atexit = False       # at interpreter exit nobody runs the model again
        entry[0] += 1
        entry[2][id(engine)] = finalizer
        return entry[1]


def release_vmemkv_attention(model, engine) -> None:
    """``engine`` off ``model``; the last one switches the model back to its own implementation
    (so a second engine on the same model keeps running on ours until it closes too)."""
    _apply_later_releases()
    _release(model, id(engine), collected=False)


def _release(model, engine_id: int, collected: bool) -> None:
    with model_lock(model):
        entry = _HOLDERS.get(model)
        finalizer = entry[2].get(engine_id) if entry is not None else None
        if finalizer is None or finalizer.alive == collected:
            return                     # released already (or the id is a newer engine's)
        finalizer.detach()
        del entry[2][engine_id]
        entry[0] -= 1
        if entry[0] == 0:
            del _HOLDERS[model]
            entry[3].remove()
            model.set_attn_implementation(entry[1])
            model.train(entry[4])      # a model in train mode was left in eval mode for good


def _apply_later_releases() -> None:
    while _RELEASE_LATER:
        model_ref, engine_id = _RELEASE_LATER.pop()
        model = model_ref()
        if model is not None:
            _release(model, engine_id, collected=True)


def _release_dropped_engines(model, args, kwargs) -> None:
    """The forward pre-hook of a model an engine holds: a forward that is not a vmemkv step
    (the user's own call, ``generate``) on our attention, which would fail, first collects
    engines dropped without ``close()`` and applies their releases, so the model runs on its
    own attention when none is left (with a live engine it still fails, naming the cause)."""
    if STEP_KWARG not in kwargs and model.config._attn_implementation == ATTN_IMPLEMENTATION:
        gc.collect()                   # a dropped engine in a reference cycle is found here
        _apply_later_releases()


@contextlib.contextmanager
def own_attention(model, own: Optional[str] = None):
    """``model`` on its own attention implementation for the block (``own``, else the one it
    had before any engine; sdpa where that is ours), then back as it was. Holds the model's
    ``model_lock`` for the block: other threads' engines on this model wait for it."""
    _apply_later_releases()
    with model_lock(model):
        now = model.config._attn_implementation
        if own is None:
            entry = _HOLDERS.get(model)
            own = entry[1] if entry is not None else now
        model.set_attn_implementation(own if own != ATTN_IMPLEMENTATION else "sdpa")
        try:
            yield model
        finally:
            model.set_attn_implementation(now)
