"""VMemLayer: one layer of a VMemCache, as transformers' mask and generate code query it.

A sliding-window layer (``is_sliding``) tells the mask code which keys its update returns, the
way transformers' own DynamicSlidingWindowLayer does: with L tokens cached before a forward of q
queries, the keys from ``kv_offset = max(L - window + 1, 0)`` on, ``kv_length = L + q -
kv_offset`` of them. The cache returns exactly that slice of its contiguous virtual tensor, so
the pages the manager gave back behind the window are never read.
"""
from __future__ import annotations

import weakref
from typing import Optional

from transformers.cache_utils import CacheLayerMixin

from ..errors import CacheStateError


def window_offset(window: Optional[int], cached_tokens: int) -> int:
    """The first key a layer with ``window`` reads in a forward after ``cached_tokens``."""
    return 0 if window is None else max(cached_tokens - window + 1, 0)


class VMemLayer(CacheLayerMixin):
    """Layer ``index`` of a VMemCache. Holds no state: everything lives in the owning cache (so
    reset/crop/reorder are done once, cache-wide)."""

    is_compileable = False   # growth maps pages from Python between ops
    is_croppable = True

    def __init__(self, owner, index: int, window: Optional[int]) -> None:
        super().__init__()
        # weak: the cache holds its layers, so a strong reference back would keep a dropped
        # cache (and its mapped memory) alive until the cycle collector runs
        self._owner, self.index, self.window = weakref.ref(owner), index, window
        self.is_sliding = window is not None
        self.is_initialized = True

    @property
    def owner(self):
        """The VMemCache this layer belongs to; CacheStateError once it has been dropped."""
        cache = self._owner()
        if cache is None:
            raise CacheStateError("this layer's VMemCache was dropped (nothing held it); a "
                                  "layer is used through its cache")
        return cache

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.index)

    def forget_last(self, tokens: int) -> None:
        """``crop``: ``keys``/``values`` lose their last ``tokens`` too, as a DynamicLayer's
        do (they kept the cropped tokens: a shape past ``get_seq_length``)."""
        if self.keys is not None and tokens:
            keep = max(self.keys.shape[2] - tokens, 0)
            self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]

    def reorder_copies(self, beam_idx) -> None:
        """``reorder_cache`` with K/V stored in another dtype: ``keys``/``values`` are decoded
        copies, not views of the reordered rows, so they take the rows too (they kept the
        rows before the reorder)."""
        if self.keys is not None:
            index = beam_idx.to(self.keys.device)
            self.keys, self.values = self.keys[index], self.values[index]

    def get_seq_length(self) -> int:
        self.owner._check_open()   # generate asks this first: a closed cache fails here, typed
        return self.owner._written[self.index]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        cached = self.get_seq_length()
        offset = window_offset(self.window, cached)
        return cached + query_length - offset, offset   # (kv_length, kv_offset)

    def get_max_length(self) -> int:
        return self.owner.max_context

    def reset(self) -> None:
        """Cache-wide: see VMemCache.reset."""

    def reorder_cache(self, beam_idx) -> None:
        """Cache-wide: see VMemCache.reorder_cache."""
