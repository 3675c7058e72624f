"""PartBinding: which pool pages back each part of each page group of a hybrid per-layer cache.

A hybrid model (full-attention layers beside sliding-window ones) splits every page group into
two PARTS (scheduler.managers.base.GroupPart): FULL, the K/V members of its full layers, and
WINDOW, those of its windowed layers. The pool holds ``pool_pages`` pages, bound to a part at
the first MapGroup that needs them and returned at ReleaseGroup:

    part p of group g bound  ->  pages[(g, p)] = (pool page, ...)   2 * len(layers of p) * k
    member j (layer j // 2) of part p, k pages  ->  pages[(g, p)][i * k : (i + 1) * k]
                                                    where i = j's position among p's members

This is bookkeeping only (pure Python, no driver call): it runs on the step thread when a plan
is bound, each change recording its inverse in the plan's journal, so the background mapper
only reads the pool pages each MapGroup was resolved to. Free pages are taken lowest first and
a released part's pages are reused next, so replicas given the same plans bind the same pages.
"""
from __future__ import annotations

from typing import Callable, Optional

from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.plan import GroupPart

from ..errors import CacheConfigError, CacheStateError

PARTS = (GroupPart.FULL, GroupPart.WINDOW)
Undo = Callable[[Callable[[], None]], None]      # records one inverse action


class PartLayout:
    """Which layers and page-group members belong to each part (the geometry's split)."""

    def __init__(self, geometry: PageGeometry, layer_windows: tuple) -> None:
        if not geometry.per_layer:
            raise CacheConfigError(f"pool_pages (a hybrid pool of part-bound pages) needs the "
                                   f"per-layer layout, got layout {geometry.layout}")
        if not layer_windows or None not in layer_windows:
            raise CacheConfigError(
                f"pool_pages (a hybrid pool of part-bound pages) needs a CacheConfig with both "
                f"full and windowed layers; its layer_windows are {layer_windows!r}")
        windowed = tuple(l for l, w in enumerate(layer_windows) if w is not None)
        if geometry.window_layers != windowed:
            raise CacheConfigError(
                f"pool_pages: the page geometry splits groups at windowed layers "
                f"{geometry.window_layers}, the CacheConfig's windowed layers are {windowed} "
                f"(build the geometry with PageGeometry.of(config, ...))")
        self.layers = {p: geometry.part_layers(p) for p in PARTS}
        self.window_tokens = max(w for w in layer_windows if w is not None)
        self.part_of_layer = {l: p for p in PARTS for l in self.layers[p]}
        k = geometry.pages_per_member  # member j -> offset of its k pages in its part's pages
        self.member_offset = {j: i * k for p in PARTS for i, j in enumerate(geometry.part_members(p))}
        self._part_pages = {p: geometry.pages_per_part(p) for p in PARTS}

    def parts(self, part: str) -> tuple:
        """The concrete parts an op's ``part`` names ("all" = both); CacheStateError otherwise."""
        if part == GroupPart.ALL:
            return PARTS
        if part in PARTS:
            return (part,)
        raise CacheStateError(f"unknown group part {part!r}; one of {', '.join(GroupPart.NAMES)}")

    def part_pages(self, part: str) -> int:
        """Pool pages one part of one page group takes."""
        return self._part_pages[part]


class PartBinding:
    """The pool pages bound to each (group, part) and where each part is mapped.

    Invariants (``check_integrity``): bound pages are disjoint and, with the free pages, are
    exactly the pool; a part is mapped only while bound, and its count of mappings equals the
    (slot, page index) spots that map it.
    """

    def __init__(self, layout: PartLayout, pool_pages: int) -> None:
        self.layout = layout
        self.pool_pages = pool_pages
        self._free = list(range(pool_pages - 1, -1, -1))     # pop() takes the lowest first
        self._bound: dict[tuple, tuple] = {}                  # (group, part) -> pool pages
        self._maps: dict[tuple, int] = {}                     # (group, part) -> mappings
        self._mapped: dict[tuple, dict] = {}                  # (slot, page index) -> {part: group}

    # -- queries --
    @property
    def bound_pages(self) -> int:
        return self.pool_pages - len(self._free)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages(self, group: int, part: str) -> Optional[tuple]:
        return self._bound.get((group, part))

    def has(self, slot: int, page_index: int, part: str) -> bool:
        """Whether ``part`` (FULL or WINDOW) is mapped under (slot, page_index)."""
        return part in self._mapped.get((slot, page_index), ())

    def parts_at(self, slot: int, page_index: int) -> dict:
        """{part: group} mapped under (slot, page_index) right now."""
        return dict(self._mapped.get((slot, page_index), {}))

    def mapped_spots(self) -> dict:
        return {spot: dict(parts) for spot, parts in self._mapped.items()}

    # -- plan bookkeeping: each change records its inverse with ``undo`` --
    def map(self, slot: int, page_index: int, group: int, part: str, undo: Undo) -> dict:
        """Mark ``part`` of ``group`` mapped under (slot, page_index), binding free pages to a
        part that has none; returns {part: pool pages} to map. CacheStateError (nothing changed)
        if a part is already mapped there, another group is, or the pool has too few pages."""
        parts = self.layout.parts(part)
        spot = self._mapped.get((slot, page_index), {})
        for p in parts:
            if p in spot:
                raise CacheStateError(f"MapGroup of group {group} part {p!r} under slot {slot} page "
                                      f"{page_index}: that part is already mapped there (group {spot[p]})")
        if any(g != group for g in spot.values()):
            raise CacheStateError(f"MapGroup of group {group} under slot {slot} page {page_index}: "
                                  f"group {next(iter(spot.values()))} is mapped there")
        need = sum(self.layout.part_pages(p) for p in parts if (group, p) not in self._bound)
        if need > len(self._free):
            raise CacheStateError(f"MapGroup of group {group} part {part!r} needs {need} free pool "
                                  f"pages to bind; {len(self._free)} of {self.pool_pages} are free")
        for p in parts:
            if (group, p) not in self._bound:
                self._bind(group, p, undo)
            self._set_mapped(slot, page_index, p, group, undo)
        return {p: self._bound[(group, p)] for p in parts}

    def unmap(self, slot: int, page_index: int, group: int, part: str, undo: Undo) -> tuple:
        """Mark ``part`` unmapped under (slot, page_index) (its pages stay bound); returns the
        concrete parts. CacheStateError (nothing changed) if it is not mapped there as ``group``."""
        parts = self.layout.parts(part)
        spot = self._mapped.get((slot, page_index), {})
        for p in parts:
            if spot.get(p) != group:
                raise CacheStateError(f"UnmapGroup of group {group} part {p!r} under slot {slot} "
                                      f"page {page_index}: it is not mapped there (mapped: {spot})")
        for p in parts:
            self._set_mapped(slot, page_index, p, None, undo)
        return parts

    def release(self, group: int, part: str, undo: Undo) -> None:
        """Return the pages bound to ``part`` of ``group`` to the free pages. CacheStateError
        (nothing changed) if a part is not bound or still mapped somewhere."""
        parts = self.layout.parts(part)
        for p in parts:
            if (group, p) not in self._bound:
                raise CacheStateError(f"ReleaseGroup of group {group} part {p!r}: no pages are bound to it")
            if self._maps.get((group, p)):
                raise CacheStateError(f"ReleaseGroup of group {group} part {p!r}: it is still mapped "
                                      f"at {self._maps[(group, p)]} spot(s); unmap it first")
        for p in parts:
            pages = self._bound.pop((group, p))
            self._free.extend(reversed(pages))
            undo(lambda key=(group, p), pages=pages: self._unrelease(key, pages))

    def _bind(self, group: int, part: str, undo: Undo) -> None:
        pages = tuple(self._free.pop() for _ in range(self.layout.part_pages(part)))
        self._bound[(group, part)] = pages
        undo(lambda key=(group, part): self._free.extend(reversed(self._bound.pop(key))))

    def _unrelease(self, key: tuple, pages: tuple) -> None:
        del self._free[len(self._free) - len(pages):]
        self._bound[key] = pages

    def _set_mapped(self, slot: int, page_index: int, part: str, group: Optional[int],
                    undo: Undo) -> None:
        """Set what ``part`` under (slot, page_index) maps (None: nothing), counting mappings."""
        spot = self._mapped.setdefault((slot, page_index), {})
        old = spot.get(part)
        if old is not None:
            self._maps[(old, part)] -= 1
            del spot[part]
        if group is not None:
            self._maps[(group, part)] = self._maps.get((group, part), 0) + 1
            spot[part] = group
        if not spot:
            del self._mapped[(slot, page_index)]
        if undo is not None:
            undo(lambda: self._set_mapped(slot, page_index, part, old, None))

    def check_integrity(self) -> None:
        """Assert the invariants above (AssertionError on a bug)."""
        taken = [page for pages in self._bound.values() for page in pages]
        assert sorted(taken + self._free) == list(range(self.pool_pages)), "bound + free != pool"
        counts: dict = {}
        for parts in self._mapped.values():
            assert parts, "an empty spot is recorded"
            for p, g in parts.items():
                assert (g, p) in self._bound, f"group {g} part {p} mapped while unbound"
                counts[(g, p)] = counts.get((g, p), 0) + 1
        assert counts == {key: n for key, n in self._maps.items() if n}, "mapping counts"
