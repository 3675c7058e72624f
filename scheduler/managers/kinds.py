"""Layer kinds: the classes of a model's layers that share one attention pattern, and so one
table of memory (the full-attention layers, the layers of one sliding window, ...).

    kinds_of(gemma3)  ->  (KindSpec("full", layers=(5, 11, ...), window_tokens=None),
                           KindSpec("window-1024", layers=(0, 1, 2, 3, 4, 6, ...), 1024))

A kind differs from another only in which tokens its layers still read: a full kind reads all
of them, a windowed kind only the last ``window_tokens`` before each query, so it may give back
what lies wholly behind its window. Managers keep one table per kind over one page ledger
(ledger.py, ``KindTable`` below); a model whose layers are all full, or all of one window, has
one kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional

from ..errors import ConfigError
from ..layout import whole_kind_name
from ..presets import ModelSpec
from .journal import JList
from .ledger import PageLedger


@dataclass(frozen=True)
class KindSpec:
    """One layer kind: its ``name``, the model ``layers`` it covers (ascending), and the
    sliding window its layers attend within (tokens; None: full attention)."""
    name: str
    layers: tuple
    window_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        layers = self.layers
        if (not isinstance(layers, tuple) or not layers or list(layers) != sorted(set(layers))
                or any(isinstance(l, bool) or not isinstance(l, int) or l < 0 for l in layers)):
            raise ConfigError(f"KindSpec {self.name!r} layers must be a non-empty ascending "
                              f"tuple of distinct layer indexes, got {layers!r}")
        w = self.window_tokens
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(f"KindSpec {self.name!r} window_tokens must be None or an int "
                              f">= 1, got {w!r}")

    @property
    def windowed(self) -> bool:
        return self.window_tokens is not None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def kinds_of(model: ModelSpec) -> tuple:
    """The model's layer kinds: full layers first (named "full"), then one kind per distinct
    window, narrowest first (named "window-W"). Every layer is in exactly one."""
    windows = model.layer_windows or (None,) * model.num_layers
    full = tuple(i for i, w in enumerate(windows) if w is None)
    kinds = [KindSpec("full", full)] if full else []
    for w in sorted({w for w in windows if w is not None}):
        kinds.append(KindSpec(f"window-{w}", tuple(i for i, x in enumerate(windows) if x == w), w))
    return tuple(kinds)


def layer_kinds(model: ModelSpec, geometry, split: bool) -> tuple:
    """The kinds a vmem manager's ops name: a split hybrid's full and windowed layers (one
    window: ``local_window_tokens``), else one kind of every layer."""
    if split:
        w = model.local_window_tokens
        return (KindSpec("full", geometry.full_layers),
                KindSpec(f"window-{w}", geometry.window_layers, w))
    w = model.window_tokens
    return (KindSpec(whole_kind_name(w), tuple(range(model.num_layers)), w),)


def pool_pages_for(cache_bytes: int, page_bytes: int, num_members: int,
                   gives_back: bool) -> int:
    """Pool pages ``cache_bytes`` buys: whole slices of every member (a pool whose groups keep
    every kind), else whole pages (one that gives windowed kinds back)."""
    if gives_back:
        return cache_bytes // page_bytes
    return cache_bytes // (page_bytes * num_members) * num_members


@dataclass(frozen=True)
class VmemShape:
    """A vmem pool's shape, checked: its layer ``kinds`` and the ``windowed`` ones given back
    behind the window (indexes), page ids for ``max_cache_bytes`` (``pool_pages``) of which
    ``cache_bytes`` buys ``service_pages``, page groups, slots and pages per slot;
    ``adapter_pages``: a static split's LoRA adapter pages (None: adapters share the pool)."""
    kinds: tuple
    windowed: tuple
    pool_pages: int
    service_pages: int
    num_groups: int
    num_slots: int
    pages_per_slot: int
    adapter_pages: Optional[int]

    @classmethod
    def of(cls, model: ModelSpec, geo, cache_bytes: int, max_cache_bytes: Optional[int],
           max_slots: Optional[int], max_seq_len: int, hybrid_parts: bool,
           adapter_budget_bytes: Optional[int] = None) -> "VmemShape":
        from .adapters import adapter_budget_units
        from .common import check_int
        tpp, page_bytes, m = geo.tokens_per_page, geo.page_bytes, geo.num_members
        adapter_pages = adapter_budget_units(adapter_budget_bytes, page_bytes, cache_bytes,
                                             "pool page")
        if adapter_pages is not None:
            if max_cache_bytes not in (None, cache_bytes):
                raise ConfigError(f"adapter_budget_bytes (a static split) needs a pool that "
                                  f"does not resize: max_cache_bytes={max_cache_bytes} must be "
                                  f"None or cache_bytes={cache_bytes}")
            cache_bytes -= adapter_budget_bytes     # KV's part; the total stays the same
            max_cache_bytes = None
        if max_seq_len % tpp:
            low, high = max_seq_len // tpp * tpp, -(-max_seq_len // tpp) * tpp
            near = f"{low} or {high}" if low else f"{high}"
            raise ConfigError(f"max_seq_len_tokens={max_seq_len} is not a multiple of "
                              f"tokens_per_page={tpp} ({geo.layout}, page_bytes={page_bytes}); "
                              f"nearest valid: {near}")
        kinds = layer_kinds(model, geo, hybrid_parts and geo.split)
        if cache_bytes // (page_bytes * m) < 1:   # a running sequence holds a page of each member
            unit = "page group" if geo.exact else "page slice (a page of each member)"
            raise ConfigError(f"cache_bytes={cache_bytes} holds no {unit} of {page_bytes * m}"
                              f" bytes; needs >= {page_bytes * m}")
        max_cache_bytes = cache_bytes if max_cache_bytes is None else max_cache_bytes
        if check_int("max_cache_bytes", max_cache_bytes, 1) < cache_bytes:
            raise ConfigError(f"max_cache_bytes={max_cache_bytes} is below cache_bytes="
                              f"{cache_bytes}")
        windowed = tuple(k for k, kind in enumerate(kinds) if kind.windowed) \
            if len(kinds) > 1 else ()
        pool_pages = pool_pages_for(max_cache_bytes, page_bytes, m, bool(windowed))
        # group ids: one per least a held group keeps (a page of each member of the kinds
        # never given back)
        kept = sum(2 * kind.num_layers if geo.per_layer else 2
                   for k, kind in enumerate(kinds) if k not in windowed)
        # every running sequence holds >= 1 slice, so more slots could never all be used at
        # once; virtual address space is cheap: exactly that many
        slices = max_cache_bytes // (page_bytes * m)
        return cls(kinds, windowed, pool_pages,
                   pool_pages_for(cache_bytes, page_bytes, m, bool(windowed)),
                   pool_pages // kept,
                   check_int("max_slots", slices if max_slots is None else max_slots, 1),
                   max_seq_len // tpp, adapter_pages)


class KindTable:
    """Per layer kind, the pool pages backing each page group (its EXTENT: member page i of the
    kind's member c is ``extent[i * members + c]``, member page 0 up), taken from and given
    back to one PageLedger whose tenants are the kinds' names. Journaled like the ledger.

        table.resize(k, g, 2)    # kind k of group g backed by 2 pages of each member: the
                                 # pages taken (() when it shrank: they went back)
    """

    __slots__ = ("kinds", "members", "ledger", "_extents")

    def __init__(self, cell, kinds: tuple, per_layer: bool, num_groups: int,
                 pool_pages: int, in_service_pages: Optional[int] = None) -> None:
        self.kinds = kinds
        self.members = tuple(2 * k.num_layers if per_layer else 2 for k in kinds)
        self.ledger = PageLedger(cell, pool_pages, in_service_pages)
        self._extents = tuple(JList(cell, [()] * num_groups) for _ in kinds)

    def extent(self, k: int, g: int) -> tuple:
        return self._extents[k][g]

    def backed(self, k: int, g: int) -> int:
        """Member pages of kind ``k`` of group ``g`` that are backed (0..pages_per_member)."""
        return len(self._extents[k][g]) // self.members[k]

    def pages_of(self, g: int) -> int:
        """Pool pages backing ``g``, every kind."""
        return sum(len(extents[g]) for extents in self._extents)

    def resize(self, k: int, g: int, member_pages: int) -> tuple:
        """Back kind ``k`` of ``g`` by its first ``member_pages`` pages of each member; returns
        the pool pages taken (OutOfCapacityError, nothing changed, when too few are free)."""
        extent, want = self._extents[k][g], member_pages * self.members[k]
        if want > len(extent):
            new = self.ledger.take(want - len(extent), self.kinds[k].name)
            self._extents[k][g] = extent + new
            return new
        self._extents[k][g] = extent[:want]
        self.ledger.give(extent[want:])
        return ()

    def check_integrity(self) -> None:
        """The ledger's pages each held once, by the kind whose extents name them."""
        self.ledger.check_integrity()
        for k, kind in enumerate(self.kinds):      # whole columns at once: run every step
            extents, members = self._extents[k], self.members[k]
            pages = list(chain.from_iterable(extents))
            assert not any(n % members for n in map(len, extents)), ("members", kind.name)
            assert len(pages) == self.ledger.held(kind.name), ("pages held", kind.name)
            assert set(map(self.ledger.holder, pages)) <= {kind.name}, ("holder", kind.name)

    def journaled_fields(self) -> bool:
        """Every container logs its changes (``journal.journaled``)."""
        return True
