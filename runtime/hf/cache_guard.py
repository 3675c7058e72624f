"""Which thread's forward is writing a VMemCache: one cache serves one ``generate`` at a time.

A forward writes layer 0, 1, ... in order, every layer at the same positions; a second thread's
forward on the same cache, interleaved with it, would append its K/V to the first one's rows and
both would get wrong tokens. ``ForwardGuard.writing(layer)`` around each update refuses
(CacheStateError, nothing written) an update from a thread other than the one whose forward is
open: from its first update until it writes the top layer (or the cache is ``reset()``); after
such a clash every update, of either thread, is refused until ``reset()`` (the rows may mix both
calls' tokens), so neither generate goes on with wrong tokens. A ``reset()`` by another thread
while a forward is open revokes that forward: the rest of its updates are refused (its cached
K/V are gone; it once went on over the emptied rows), until its thread starts a forward over.
Cheap: one non-blocking lock and a few compares per layer. A cache may still pass from thread
to thread between forwards (a generate finished in one, continued in another); so two generate
calls whose forwards happen to alternate whole, never overlapping, are not told apart from such
a hand-over (nor a reset() between two forwards of a generate in another thread).

The top layer (the last one a forward writes) is, for a cache built from a model's config
(``bind_model``), the last layer below Gemma 3n's KV-shared ones (``num_kv_shared_layers``: they
read another layer's K/V and never write); without a config, the last of the cache's layers until
a forward by the same thread starts over below it, then the layer it stopped at, until
``reset()``. (Learnt only so: a retry after a forward interrupted part-way looks the same, and
once left the guard blind to a second thread's forward above that layer: wrong logits.) A forward
that raised part-way keeps the cache for its thread (its rows hold a partial step) until that
thread's next forward or ``reset()``; that next forward is refused at its first update, its
layers up to ``top_layer`` holding different lengths (``cache_checks.check_layers_even``), so
only ``reset()`` goes on. A model switched to the ``"vmemkv"`` attention (an Engine
holds it) is refused before its first layer writes: that attention reads the engine's cache, not
this one.
"""
from __future__ import annotations

import contextlib
import threading

from ..errors import CacheStateError
from .attention import ATTN_IMPLEMENTATION


class ForwardGuard:
    def __init__(self, num_layers: int) -> None:
        self._busy = threading.Lock()
        self._owner = None            # thread ident of the open forward, None between forwards
        self._last_layer = -1         # the last layer it wrote
        self._top_layer = self._top_of_cache = num_layers - 1
        self._learn_top = True        # no model config: the top layer is learnt (see above)
        self._model_config = None     # the HF config whose _attn_implementation is checked
        self._mixed = None            # why every update is refused until reset(), after a clash
        self._revoked = None          # (thread, layer): its forward, open at reset() by another

    def bind_model(self, config) -> None:
        """The cache serves the model of this HF ``config``: its top writing layer is known,
        and its attention implementation is checked before each forward's first write."""
        text = getattr(config, "get_text_config", lambda: config)()
        shared = getattr(text, "num_kv_shared_layers", 0) or 0
        self._top_layer = self._top_of_cache = self._top_of_cache - shared
        self._learn_top, self._model_config = False, config

    @property
    def top_layer(self) -> int:
        """The last layer a forward writes (see the module docstring): layers ``0..top_layer``
        of a forward that ran whole hold as many tokens."""
        return self._top_layer

    @contextlib.contextmanager
    def writing(self, layer_idx: int):
        me = threading.get_ident()
        if not self._busy.acquire(blocking=False):
            raise self._refuse(layer_idx, "is writing it now")
        try:
            if self._mixed is not None:
                raise CacheStateError(self._mixed)
            self._check_not_revoked(me, layer_idx)
            if self._owner is not None and self._owner != me:
                raise self._refuse(layer_idx, f"is at layer {self._last_layer}")
            if self._owner is None and self._model_config is not None and \
                    self._model_config._attn_implementation == ATTN_IMPLEMENTATION:
                raise CacheStateError(
                    f"the model runs on the {ATTN_IMPLEMENTATION!r} attention (an Engine holds "
                    f"it), which reads the engine's cache, not this one; close the engine, or "
                    f"pass the model another attn_implementation, before generate with a "
                    f"VMemCache (nothing was written)")
            if self._learn_top and self._owner == me and layer_idx <= self._last_layer:
                self._top_layer = self._last_layer     # it started over below (see above)
            yield
            self._owner, self._last_layer = me, layer_idx
            if layer_idx >= self._top_layer:
                self._owner = None
        finally:
            self._busy.release()

    def reset(self) -> None:
        """Forget every forward. One open in another thread (at reset, it had written layers up
        to ``_last_layer``) is revoked: its remaining updates are refused (the rows it wrote are
        gone, so its queries would read only what it writes after), never its next forward."""
        me = threading.get_ident()
        if self._owner is not None and self._owner != me:
            self._revoked = (self._owner, self._last_layer)
        elif self._revoked is not None and self._revoked[0] == me:
            self._revoked = None
        self._owner, self._last_layer, self._mixed = None, -1, None
        self._top_layer = self._top_of_cache

    def _check_not_revoked(self, me: int, layer_idx: int) -> None:
        """Refuse the rest of a forward that another thread's ``reset()`` revoked; a forward of
        that thread starting over (at or below the layer it had reached) ends the revocation."""
        if self._revoked is None or self._revoked[0] != me:
            return
        reached = self._revoked[1]
        if layer_idx <= reached:
            self._revoked = None
            return
        raise CacheStateError(
            f"another thread called reset() on this cache while this thread's forward had "
            f"written layers up to {reached}, so the K/V it cached are gone and layer "
            f"{layer_idx} would attend over its own new tokens only (wrong tokens); nothing was "
            f"written: start the generate again")

    def _refuse(self, layer_idx: int, where: str) -> CacheStateError:
        """The refusal of this update; every later one (either thread's) is refused too, until
        ``reset()``: the cache's rows may hold both threads' tokens."""
        self._mixed = ("this cache was written by two threads' forwards at once, so its rows may "
                       "mix both calls' tokens; call reset() before using it again")
        return CacheStateError(
            f"this cache is in use by another thread's forward (it {where}; this update was for "
            f"layer {layer_idx}); one VMemCache serves one generate at a time: give each thread "
            f"its own cache (or reset() it after a forward that raised part-way)")
