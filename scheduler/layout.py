"""The declared cache layout: what a manager tells an executor so it can build the cache that runs
its plans, and nothing else (plain data, frozen, picklable).

    layout = manager.layout()                       # scheduler side
    cache = cache_from_layout(layout, config)       # any process (runtime.kv)

Executors read this value, never the manager: no attribute probing, no policy names. The kind
is a ``CacheKind`` (a str enum: a member equals its name, for callers that still hold one). A vmem layout names its page geometry, slots, page groups, the
``pool_pages`` its ops name and the layer kinds they name; a paged layout names its blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from .errors import ConfigError
from .geometry import PageGeometry


class _Name(str, Enum):
    """A str enum that prints as its value (as 3.11's StrEnum; this package supports 3.10)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


class CacheKind(_Name):
    """What memory a cache is made of."""
    VMEM = "vmem"      # slots of page indexes mapped to physical pages (vmem.VirtualRange)
    PAGED = "paged"    # a preallocated pool of fixed blocks, read through block tables


class PoolBacking(_Name):
    """The vmem backing rule, from the geometry (the manager's accounting; the executor maps
    whatever pages the ops name, the same way for both)."""
    WHOLE = "whole"    # pages hold whole tokens: a group binds every member page when taken
    BYTES = "bytes"    # members span k > 1 pages: a group backed by the pages its bytes need


@dataclass(frozen=True)
class CacheLayout:
    """Everything an executor needs to build the cache for one manager's plans.

    vmem: ``geometry``, ``num_slots`` slots of ``pages_per_slot`` page indexes, ``num_groups``
    group ids, ``backing``, ``pool_pages`` physical pages in the pool (the ops name pages
    0..pool_pages-1; the last ``released_pages`` of them start given back to the device, with
    no memory behind them, until a resize takes them back) and ``kinds``: ((name, layers),
    ...), the layer kinds ops name, whose members (K/V of each layer, in layer order) every
    layer is one of.
    paged: ``num_blocks`` blocks of ``block_size_tokens`` tokens (a hybrid: ``block_groups``,
    the layers each block group's blocks hold, one block table per group). Validated on construction
    (ConfigError naming the field); unused fields of the other kind stay at their defaults.
    ``adapter_pool_pages`` (both kinds; 0: LoRA adapters share the pool): a static split's
    adapter pages (vmem) or blocks (paged), named by the adapter ops after the pool's own
    (``pool_pages`` / ``num_blocks`` on).
    """
    kind: CacheKind
    max_seq_len_tokens: int                 # the longest sequence one slot / block table holds
    geometry: Optional[PageGeometry] = None
    num_slots: int = 0
    pages_per_slot: int = 0
    num_groups: int = 0
    backing: PoolBacking = PoolBacking.WHOLE
    pool_pages: Optional[int] = None
    block_size_tokens: int = 0
    num_blocks: int = 0
    kinds: tuple = ()
    block_groups: tuple = ()                # paged hybrid: layers per block group; (): one
    released_pages: int = 0                 # vmem: pool pages past cache_bytes (elastic pools)
    adapter_pool_pages: int = 0             # a static split's adapter pages / blocks

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CacheKind(self.kind))
        object.__setattr__(self, "backing", PoolBacking(self.backing))
        _positive("max_seq_len_tokens", self.max_seq_len_tokens)
        if isinstance(self.adapter_pool_pages, bool) or not isinstance(
                self.adapter_pool_pages, int) or self.adapter_pool_pages < 0:
            raise ConfigError(f"CacheLayout adapter_pool_pages must be an int >= 0, got "
                              f"{self.adapter_pool_pages!r}")
        if self.kind is CacheKind.PAGED:
            _positive("block_size_tokens", self.block_size_tokens)
            _positive("num_blocks", self.num_blocks)
            sizes = {len(g) for g in self.block_groups}
            layers = [l for g in self.block_groups for l in g]
            if len(sizes) > 1 or len(set(layers)) != len(layers):
                raise ConfigError(f"CacheLayout block_groups must be disjoint groups of equal "
                                  f"size, got {self.block_groups!r}")
            return
        if not isinstance(self.geometry, PageGeometry):
            raise ConfigError(f"a vmem layout needs a PageGeometry, got {self.geometry!r}")
        for name in ("num_slots", "pages_per_slot", "num_groups"):
            _positive(name, getattr(self, name))
        if self.pages_per_slot * self.geometry.tokens_per_page != self.max_seq_len_tokens:
            raise ConfigError(f"pages_per_slot={self.pages_per_slot} of "
                              f"{self.geometry.tokens_per_page} tokens does not hold "
                              f"max_seq_len_tokens={self.max_seq_len_tokens}")
        _positive("pool_pages", self.pool_pages)
        if isinstance(self.released_pages, bool) or not isinstance(self.released_pages, int) \
                or not 0 <= self.released_pages <= self.pool_pages:
            raise ConfigError(f"CacheLayout released_pages must be in 0..pool_pages, got "
                              f"{self.released_pages!r}")
        g = self.geometry
        layers = sorted(l for _, kind_layers in self.kinds for l in kind_layers)
        if layers != list(range(g.num_layers)) or (not g.per_layer and len(self.kinds) != 1):
            raise ConfigError(f"CacheLayout kinds must cover every layer of the geometry once "
                              f"(one kind in the interleaved layout), got {self.kinds!r}")
        if (self.backing is PoolBacking.WHOLE) != g.exact:
            whole = self.backing is PoolBacking.WHOLE
            need = "hold whole tokens" if whole else "hold no whole token"
            raise ConfigError(f"a {self.backing} pool needs pages that {need}; got "
                              f"{g.pages_per_member} page(s) per member")

    @property
    def total_pages(self) -> int:
        """Physical pages of a vmem pool."""
        return self.pool_pages


def whole_kind_name(window_tokens: Optional[int]) -> str:
    """The name of the one kind of a model whose groups are not split by layer kind: "full",
    or "window-W" where every layer reads only its last W tokens."""
    return "full" if window_tokens is None else f"window-{window_tokens}"


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"CacheLayout {name} must be an int >= 1, got {value!r}")
