"""Arguments of VMemCache's transformers hooks, refused before anything changes: a wrong one
would corrupt every layer's rows or lengths silently (CacheStateError names what was expected);
and how far back a windowed cache's rows may be cropped, from the memory really given back; a
``page_bytes`` whose whole pages would round ``max_context`` past what a cache holds."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..errors import CacheConfigError, CacheStateError
from .cache_layer import window_offset


def check_crop_count(tokens_to_remove) -> None:
    """``crop``'s count: a plain int, 0 or less (transformers passes ints; a float or a tensor
    would become the rows' stored lengths)."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) \
            or tokens_to_remove > 0:
        raise CacheStateError(f"crop takes a negative count of tokens to remove (a plain int, "
                              f"0 or less), got {tokens_to_remove!r}")


def sized_to_pages(config, capacity_tokens: int, geometry):
    """``config`` (a CacheConfig) holding ``capacity_tokens``, its ``max_context`` rounded up
    to whole pages of ``geometry``. CacheConfigError naming ``page_bytes`` where the rounding
    passes the longest context a CacheConfig takes (it named a max_context nobody gave)."""
    try:
        return dataclasses.replace(config, max_context=capacity_tokens)
    except CacheConfigError as error:
        raise CacheConfigError(
            f"VMemCache: page_bytes={geometry.page_bytes} makes pages of "
            f"{geometry.tokens_per_page} tokens, so max_context={config.max_context} rounds up "
            f"to {capacity_tokens} tokens of whole pages, past what a cache holds ({error}); "
            f"give a smaller page_bytes (or None, the default page)") from error


def check_layer_idx(layer_idx, num_layers: int) -> None:
    """``update``'s layer: a plain int in ``[0, num_layers)``."""
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) \
            or not 0 <= layer_idx < num_layers:
        raise CacheStateError(f"layer_idx must be an int in [0, {num_layers}) for this "
                              f"{num_layers}-layer cache, got {layer_idx!r}")


def check_beam_index(beam_idx, batch: int) -> None:
    """``reorder_cache``'s index: a 1-D int64 or int32 tensor (transformers' beam search passes
    int32) of one row in ``[0, batch)`` per row held; a shorter one would broadcast a row over
    the others. The range check reads the index once (one small sync on a GPU)."""
    if not (isinstance(beam_idx, torch.Tensor) and beam_idx.dtype in (torch.int64, torch.int32)
            and beam_idx.shape == (batch,)
            and bool(((beam_idx >= 0) & (beam_idx < batch)).all())):
        raise CacheStateError(f"reorder_cache takes a 1-D int64 or int32 tensor of one row in "
                              f"[0, {batch}) for each of the {batch} rows held, got {beam_idx!r}")


def check_update_states(config, k: torch.Tensor, v: torch.Tensor, device: torch.device) -> None:
    """``update``'s key/value states (B, kv_heads, q, head_dim): the shape and dtype of the
    cache's ``config`` (a CacheConfig), on ``device``, where the cache's tensors live (its
    index filled in: a config's ``"cuda"`` is ``cuda:<current device>``, which torch compares
    unequal to ``"cuda"``), and no autograd (``check_states_without_grad``)."""
    want = (config.num_kv_heads, config.head_dim)
    for name, t in (("key", k), ("value", v)):
        if t.dim() != 4:
            raise CacheStateError(f"{name} states must be (batch, {want[0]}, tokens, {want[1]}), "
                                  f"got {tuple(t.shape)}")
        if (t.shape[1], t.shape[3]) != want:
            raise CacheStateError(
                f"the model writes {name} states {tuple(t.shape)} of {t.shape[1]} KV heads x "
                f"{t.shape[3]} dims, but this cache holds (batch, {want[0]}, tokens, {want[1]}), "
                f"built from the model config "
                f"(num_kv_heads={want[0]}, head_dim={want[1]}): the config does not describe "
                f"this model's attention; build the cache from the model's own config")
        if t.dtype != config.dtype or t.device != device:
            raise CacheStateError(f"{name} states are {t.dtype} on {t.device}; this cache holds "
                                  f"{config.dtype} on {device} (build it with the model's dtype "
                                  f"and device)")
    if k.shape[0] != v.shape[0] or k.shape[2] != v.shape[2]:
        raise CacheStateError(f"key {tuple(k.shape)} and value {tuple(v.shape)} states differ")
    check_states_without_grad(k, v)
    config.check_storable(k, v)


def check_states_without_grad(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """``update``'s states under autograd: refused (inference only). The cache writes them in
    place into one shared pool and returns views of it, so a backward through them would fail
    in torch ("modified by an inplace operation") after the forward ran."""
    if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
        raise CacheStateError(
            "VMemCache is inference only: the key/value states require grad with grad mode on, "
            "and the cache writes them in place into shared memory, so no backward could run "
            "through it; run the forward under torch.no_grad() or torch.inference_mode() "
            "(generate does), or use transformers' DynamicCache to train (nothing was written)")


def given_back_tokens(window_tokens: Optional[int], tokens_per_page: int, start: int,
                      held_tokens: int) -> int:
    """Tokens ``[0, n)`` of a row holding ``held_tokens`` whose memory the manager's
    ``release_behind_window(row, start)`` gives back: the whole pages before the first key a
    query at ``start`` reads (``start - window_tokens + 1``), never the row's last page
    (scheduler/managers/window.py); 0 where the manager keeps every token (``None``)."""
    if window_tokens is None:
        return 0
    held_pages = -(-held_tokens // tokens_per_page)
    pages = min(window_offset(window_tokens, start) // tokens_per_page, max(held_pages - 1, 0))
    return pages * tokens_per_page


def crop_floor_tokens(window_tokens: Optional[int], given_back: int) -> int:
    """The fewest tokens a row may keep after ``crop`` (its bound): a query there reads keys
    from ``bound - window_tokens + 1 = given_back`` on, none given back; 0 while nothing was."""
    return given_back + window_tokens - 1 if given_back else 0


def check_crop_keeps_window(tokens_to_remove: int, kept_tokens: int, cached_tokens: int,
                            bound_tokens: int, window_tokens: Optional[int]) -> None:
    """``crop`` to ``kept_tokens`` (of ``cached_tokens``): refused below ``bound_tokens``
    (``crop_floor_tokens``), where the next query would read keys whose memory was given back,
    naming how far it may go."""
    if kept_tokens < bound_tokens:
        raise CacheStateError(
            f"crop({tokens_to_remove}) would leave {kept_tokens} tokens, but the windowed layers' "
            f"memory of tokens [0, {bound_tokens - window_tokens + 1}) was given back and a "
            f"query at {kept_tokens} would read it (window {window_tokens}); crop at most "
            f"{cached_tokens - bound_tokens} tokens")


def check_forward_start(written: list, top_layer: int, call_kwargs: dict, new_tokens: int) -> None:
    """A forward's first update (layer 0, the batch held), before it writes: refused
    (CacheStateError) where the cache cannot continue it exactly (``check_layers_even``,
    ``check_not_refed``); ``call_kwargs`` are ``update``'s kwargs."""
    check_layers_even(written, top_layer)
    check_not_refed(call_kwargs, written[0], new_tokens)


def check_layers_even(written: list, top_layer: int) -> None:
    """Every layer a forward writes (``0..top_layer``; Gemma 3n's KV-shared ones above never do)
    holds as many tokens: a forward that raised part-way (an error or Ctrl-C in a layer) wrote
    only the layers below it, and the next forward, positioned by layer 0's length, would write
    the others behind their last token and attend over mismatched K/V (wrong tokens)."""
    lengths = written[:top_layer + 1]
    if min(lengths) != max(lengths):
        raise CacheStateError(
            f"a forward on this cache raised part-way: its layers hold {lengths} tokens (the one "
            f"that raised wrote only the lower layers), so the next forward would attend over "
            f"K/V of different lengths (wrong tokens); nothing was written: call reset() and "
            f"generate again")


def positions_of(call_kwargs: dict) -> Optional[torch.Tensor]:
    """The ``position_ids`` (B or 1, q) transformers' attention hands ``Cache.update``
    (``kwargs=kwargs`` in 5.x), or None where a family hands none (or 3-D ones, mRoPE)."""
    inner = call_kwargs.get("kwargs")
    positions = (inner if isinstance(inner, dict) else call_kwargs).get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2:
        return positions
    return None


def check_not_refed(call_kwargs: dict, cached_tokens: int, new_tokens: int) -> None:
    """A forward of more ``new_tokens`` than the ``cached_tokens`` whose last token sits at a
    position below ``new_tokens``: it sits among the cached tokens, so it re-feeds them
    (``generate(..., use_cache=False)`` with a cache passed hands its second step the whole
    sequence and one token more), and appending it would cache each token again (wrong
    tokens; transformers' DynamicCache too). A forward that continues has its last token at
    ``cached + new - 1`` less the left padding, past ``new - 1`` while a row holds a token that
    is not padding (a chunked prefill's chunks over padding only are no longer than the cache
    holds, so they are not read)."""
    positions = positions_of(call_kwargs)
    if not 0 < cached_tokens < new_tokens or positions is None \
            or positions.shape[-1] != new_tokens:
        return
    last = int(positions[:, -1].max())          # one small sync, multi-token forwards only
    if last < new_tokens:
        raise CacheStateError(
            f"this forward hands the cache {new_tokens} tokens whose positions end at {last}, "
            f"so they sit among the {cached_tokens} tokens it holds: it re-feeds them "
            f"(generate(..., use_cache=False), or generation_config.use_cache=False, with a "
            f"cache passed; or input_ids that the cache already holds, without reset()), which "
            f"a cache would append behind what it holds (wrong tokens); nothing was written: "
            f"generate with use_cache=True (the default), or pass no cache, or reset() it")
