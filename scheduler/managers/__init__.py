"""Memory managers: the ONE place where KV allocation is decided (pure bookkeeping, no torch).

    make_manager("paged", get_model("llama-3-8b"), cache_bytes=20 * 10**9,
                 max_seq_len_tokens=4096, block_size_tokens=16)

| policy          | unit held             | sharing                         | ops emitted            |
|-----------------|-----------------------|---------------------------------|------------------------|
| reserve-max     | max_seq_len tokens    | none                            | SwapOut/SwapIn         |
| reserve-oracle  | final length tokens   | none                            | SwapOut/SwapIn         |
| paged           | blocks of block_size  | fork + prefix (chain hash), CoW | CopyBlock, swaps       |
| vmem            | page groups in slots  | fork + prefix (chain hash), CoW | Map/Unmap/CopyExtent   |

vmem is one VmemManager whose page groups are per-kind extents (kinds.py): backed whole, or by
the bytes their tokens need where pages hold no whole token; with a hybrid model (full +
sliding-window layers) in the per-layer layout and ``hybrid_parts=True`` the windowed kind is
given back behind the window (vmem_kinds.py). Every vmem op names the pool pages it maps,
taken from the manager's one PageLedger (ledger.py).

paged and vmem keep computed prefixes after their requests end (``prefix_eviction``: off, lru,
hits; eviction.py) and publish a unit only once the scheduler says it is computed.

paged and vmem hold LoRA adapters' weights as tenants of the same ledger (adapters.py:
LoadAdapter / EvictAdapter, idle adapters evicted for KV before any allocation fails), or with
``adapter_budget_bytes`` in a static split of the pool; reserve-* refuse adapters by name.
"""
from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from ..presets import ModelSpec
from .base import (AdapterStats, CopyBlock, CopyExtent, EvictAdapter, LoadAdapter, MapExtent,
                   MemoryManager, MemoryOp, MemoryStats, SwapIn, SwapOut, UnmapExtent)
from .common import check_int
from .eviction import DEFAULT_EVICTION, EVICTION_POLICIES, make_eviction
from .paged import PagedManager
from .reserve import ReserveManager
from .vmem import LAYOUTS, VmemManager

POLICIES = ("reserve-max", "reserve-oracle", "paged", "vmem")


def make_manager(policy: str, model: ModelSpec, cache_bytes: int, max_seq_len_tokens: int, *,
                 block_size_tokens: int = 16, page_bytes: int = 2 * 2**20,
                 layout: str = "per-layer", max_slots: Optional[int] = None,
                 swap_bytes: int = 0, prefix_eviction: str = DEFAULT_EVICTION,
                 hybrid_parts: bool = False, prefix_block_tokens: int = 16,
                 max_cache_bytes: Optional[int] = None,
                 adapter_budget_bytes: Optional[int] = None) -> MemoryManager:
    """A manager for ``policy`` over ``cache_bytes`` of KV cache (bytes), sequences of at most
    ``max_seq_len_tokens``. ``block_size_tokens`` is used by paged only; ``page_bytes``,
    ``layout`` and ``max_slots`` by vmem only; ``swap_bytes`` is host swap space (all);
    ``prefix_eviction`` (paged, vmem; one of EVICTION_POLICIES) keeps computed prefixes after
    their requests end and says which goes first ("off": none are kept). ``hybrid_parts``
    (vmem per-layer with a hybrid model only; ignored otherwise): split page groups by layer
    kind and give back the windowed kind behind the window, for an executor of this
    version's ops; False: full allocation. ``prefix_block_tokens`` (vmem only): prefix hits
    in blocks of this many tokens whatever the page holds, the part of a page copied (0: whole
    page groups only; ignored where a page holds no more than one block, or with windows).
    ``max_cache_bytes`` (vmem only): the most ``resize`` may grow the pool to (default
    ``cache_bytes``); the others refuse one above ``cache_bytes``. ``adapter_budget_bytes``
    (paged, vmem; None: LoRA adapters share the KV pool, adapters.py): a static split, that
    many of the ``cache_bytes`` for adapters only, the rest for KV.
    Raises ConfigError naming the field, the value and the allowed range."""
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    check_int("cache_bytes", cache_bytes, 1)
    check_int("max_seq_len_tokens", max_seq_len_tokens, 1)
    check_int("block_size_tokens", block_size_tokens, 1)
    check_int("page_bytes", page_bytes, 1)
    check_int("swap_bytes", swap_bytes, 0)
    if max_slots is not None:
        check_int("max_slots", max_slots, 1)
    make_eviction(prefix_eviction)       # ConfigError for an unknown name, before anything
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if policy != "vmem" and max_cache_bytes not in (None, cache_bytes):
        raise ConfigError(f"max_cache_bytes needs policy 'vmem' (only its pool resizes), got "
                          f"{policy!r}")
    if policy in ("reserve-max", "reserve-oracle"):
        if adapter_budget_bytes is not None:
            raise ConfigError(f"adapter_budget_bytes needs policy 'vmem' or 'paged' (adapters "
                              f"take their pages or blocks), got {policy!r}")
        return ReserveManager(model, cache_bytes, max_seq_len_tokens,
                              oracle=policy == "reserve-oracle", swap_bytes=swap_bytes)
    if policy == "paged":
        return PagedManager(model, cache_bytes, max_seq_len_tokens,
                            block_size_tokens=block_size_tokens, swap_bytes=swap_bytes,
                            prefix_eviction=prefix_eviction,
                            adapter_budget_bytes=adapter_budget_bytes)
    if not isinstance(hybrid_parts, bool):
        raise ConfigError(f"hybrid_parts must be a bool, got {hybrid_parts!r}")
    return VmemManager(model, cache_bytes, max_seq_len_tokens, page_bytes=page_bytes,
                       layout=layout, max_slots=max_slots, swap_bytes=swap_bytes,
                       prefix_eviction=prefix_eviction, hybrid_parts=hybrid_parts,
                       prefix_block_tokens=prefix_block_tokens, max_cache_bytes=max_cache_bytes,
                       adapter_budget_bytes=adapter_budget_bytes)


__all__ = ["POLICIES", "EVICTION_POLICIES", "DEFAULT_EVICTION", "make_manager", "MemoryManager", "MemoryStats", "MemoryOp", "MapExtent",
           "UnmapExtent", "CopyExtent", "CopyBlock", "SwapOut", "SwapIn", "LoadAdapter",
           "EvictAdapter", "AdapterStats", "ReserveManager",
           "PagedManager", "VmemManager"]
