"""SliceOps: the byte-mapped side of VMemKVCache, where a page-group member spans k > 1 pages and
each group is backed only by the pages its tokens' bytes need (scheduler.managers.vmem_bytes).

The pool (``pool_pages`` pages) is cut into SLICES of ``num_members`` pages, one page of every
member; a group's backing is a list of slices, member page i of the group is slice i:

    slice s                         ->  pool pages [s * M, (s + 1) * M)       M = num_members
    member j, page i of group g     ->  pool page slices[g][i] * M + j
    mapped under (slot, pi)         ->  range page ((j * B + slot) * P + pi) * k + i

Every mapping of a group maps exactly its backed pages: MapGroup maps them, UnmapGroup unmaps
them, ResizeGroup(g, m) binds free slices to pages m_old..m-1 and maps them wherever g is
mapped (or unmaps pages m..m_old-1 everywhere and frees their slices), CopyGroup copies the
source's backed pages. As with the hybrid binding (vmem_binding), all of this is checked and
bound on the step thread in plan order, each change journaled, so a refused plan changes
nothing and the (background) application only reads each op's resolved payload. Free slices
are taken lowest first and a freed slice is reused next, so replicas bind the same pages.
"""
from __future__ import annotations

from typing import Optional

from vmemkv.scheduler.plan import CopyGroup, MapGroup, ResizeGroup, UnmapGroup

from vmemkv.scheduler.geometry import PageGeometry

from ..errors import CacheConfigError, CacheStateError
from .journal import PlanJournal

SLICE_OPS = (MapGroup, UnmapGroup, ResizeGroup, CopyGroup)


class SliceBinding:
    """The slices backing each page group and the spots (slot, page index) mapping it.

    Invariants (``check_integrity``): bound slices are disjoint and, with the free ones, are
    every slice of the pool; no group has more than ``pages_per_member`` of them."""

    def __init__(self, num_slices: int, pages_per_member: int) -> None:
        self.num_slices, self.pages_per_member = num_slices, pages_per_member
        self._free = list(range(num_slices - 1, -1, -1))      # pop() takes the lowest first
        self._slices: dict[int, list] = {}                     # group -> slice ids
        self._spots: dict[int, set] = {}                       # group -> {(slot, page index)}

    @property
    def bound_slices(self) -> int:
        return self.num_slices - len(self._free)

    def backing(self, group: int) -> int:
        """Pages of each member of ``group`` that are backed."""
        return len(self._slices.get(group, ()))

    def slices(self, group: int) -> tuple:
        return tuple(self._slices.get(group, ()))

    def spots(self, group: int) -> tuple:
        return tuple(sorted(self._spots.get(group, ())))

    # -- plan bookkeeping: each change records its inverse with ``undo`` --
    def map(self, slot: int, page_index: int, group: int, undo) -> tuple:
        """``group`` is mapped at (slot, page index) too; returns its slices to map there."""
        spots = self._spots.setdefault(group, set())
        spots.add((slot, page_index))
        undo(lambda: spots.discard((slot, page_index)))
        return self.slices(group)

    def unmap(self, slot: int, page_index: int, group: int, undo) -> int:
        """``group`` leaves (slot, page index); returns how many pages per member to unmap."""
        spots = self._spots.get(group, set())
        spots.discard((slot, page_index))
        undo(lambda: spots.add((slot, page_index)))
        return self.backing(group)

    def resize(self, group: int, pages: int, undo) -> tuple:
        """Back ``group`` by ``pages`` pages per member: (spots, [(page i, slice)] bound or
        freed, grew). CacheStateError (nothing changed) outside 0..k or past the free slices."""
        held = self._slices.setdefault(group, [])
        if not 0 <= pages <= self.pages_per_member:
            raise CacheStateError(f"ResizeGroup of group {group} to {pages} pages per member: "
                                  f"outside 0..{self.pages_per_member}")
        if pages - len(held) > len(self._free):
            raise CacheStateError(f"ResizeGroup of group {group} to {pages} pages per member needs "
                                  f"{pages - len(held)} free slices; {len(self._free)} of "
                                  f"{self.num_slices} are free")
        grew = pages > len(held)
        if grew:
            changed = [(i, self._free.pop()) for i in range(len(held), pages)]
            held.extend(s for _, s in changed)
            undo(lambda n=len(changed): self._free.extend(reversed([held.pop() for _ in range(n)])))
        else:
            changed = [(i, held[i]) for i in range(pages, len(held))]
            del held[pages:]
            self._free.extend(reversed([s for _, s in changed]))
            undo(lambda c=changed: (held.extend(s for _, s in c), self._unfree(len(c))))
        return self.spots(group), changed, grew

    def _unfree(self, count: int) -> None:
        del self._free[len(self._free) - count:]

    def check_integrity(self) -> None:
        taken = [s for slices in self._slices.values() for s in slices]
        assert sorted(taken + self._free) == list(range(self.num_slices)), "bound + free != pool"
        assert all(len(s) <= self.pages_per_member for s in self._slices.values())


class SliceOps:
    """Mixed into VMemKVCache (beside VMemOps, whose ``_first_page`` it uses); used only when
    ``self._slices`` is set (a byte-mapped pool)."""

    _slices: Optional[SliceBinding] = None

    @staticmethod
    def _slice_binding(geometry: PageGeometry, pool_pages) -> Optional[SliceBinding]:
        """The binding of a byte-mapped pool (k > 1, groups not split), else None."""
        if pool_pages is None or geometry.split or geometry.exact:
            return None
        m = geometry.num_members
        if isinstance(pool_pages, bool) or not isinstance(pool_pages, int) or pool_pages < m \
                or pool_pages % m:
            raise CacheConfigError(f"pool_pages must be a positive multiple of the {m} members "
                                   f"of a page group (one slice each), got {pool_pages!r}")
        return SliceBinding(pool_pages // m, geometry.pages_per_member)

    def _bind_slice_op(self, op, payload, undo):
        """The payload ``op`` is applied with, after checking it and updating the replica and
        the binding (CacheStateError, nothing changed by this op, if it cannot run)."""
        binding = self._slices
        if isinstance(op, (MapGroup, ResizeGroup)) and not 0 <= op.group < self.num_groups:
            raise CacheStateError(f"{op!r} names group {op.group}, outside 0..{self.num_groups - 1}")
        if isinstance(op, MapGroup):
            self._set_replica(op.slot, op.page_index, op.group, undo)
            return binding.map(op.slot, op.page_index, op.group, undo)
        if isinstance(op, UnmapGroup):
            if self._slot_pages[op.slot].get(op.page_index) != op.group:
                raise CacheStateError(f"{op!r}: group {op.group} is not mapped there")
            self._set_replica(op.slot, op.page_index, None, undo)
            return binding.unmap(op.slot, op.page_index, op.group, undo)
        if isinstance(op, ResizeGroup):
            return binding.resize(op.group, op.member_pages, undo)
        if isinstance(op, CopyGroup):
            src = self._slot_pages[op.src_slot].get(op.src_page_index)
            dst = self._slot_pages[op.dst_slot].get(op.dst_page_index)
            if src is None or dst is None or binding.backing(dst) < binding.backing(src):
                raise CacheStateError(f"{op!r}: needs both mapped and the destination backed as "
                                      f"far as the source")
            return binding.backing(src)
        return payload

    def _set_replica(self, slot: int, page_index: int, group: Optional[int], undo) -> None:
        pages = self._slot_pages[slot]
        old = pages.get(page_index)
        if group is not None and old is not None:
            raise CacheStateError(f"MapGroup of group {group} under slot {slot} page {page_index}: "
                                  f"group {old} is mapped there")
        if group is None:
            del pages[page_index]
        else:
            pages[page_index] = group
        undo(lambda: pages.pop(page_index, None) if old is None else pages.__setitem__(page_index, old))

    def _slice_unmaps(self, op, payload, members: int) -> int:
        """Range pages ``op`` unmaps in one op group of ``members`` members."""
        if isinstance(op, UnmapGroup):
            return payload * members
        if isinstance(op, ResizeGroup) and not payload[2]:
            return len(payload[0]) * len(payload[1]) * members
        return 0

    def _apply_slice_op(self, op, payload, members: tuple, journal: PlanJournal) -> None:
        """Apply a bound slice op to ``members`` (one op group), journaling every primitive."""
        rng, first, m = self.range, self._first_page, self.geometry.num_members
        if isinstance(op, MapGroup):
            spots, changed, grew = ((op.slot, op.page_index),), list(enumerate(payload)), True
        elif isinstance(op, UnmapGroup):
            spots, changed, grew = ((op.slot, op.page_index),), [(i, None) for i in range(payload)], False
        elif isinstance(op, ResizeGroup):
            spots, changed, grew = payload
        else:                                   # CopyGroup: the source's backed pages
            for j in members:
                dst, src = first(j, op.dst_slot, op.dst_page_index), first(j, op.src_slot, op.src_page_index)
                for i in range(payload):
                    self._save_bytes(journal, (dst + i) * self.page_bytes, self.page_bytes)
                    rng.copy_page(dst + i, src + i)
            return
        for slot, page_index in spots:
            for j in members:
                base = first(j, slot, page_index)
                for i, s in changed:
                    if grew:
                        rng.map(base + i, self._pool_pages[s * m + j])
                        journal.add(lambda p=base + i: rng.unmap(p))
                    else:
                        page_id = rng.unmap(base + i)
                        journal.add(lambda p=base + i, pid=page_id: rng.map(p, pid))

    def _slice_held_tokens(self, pages: dict) -> int:
        """Tokens of a slot's run of mapped groups whose bytes lie in backed pages."""
        n, tpp = self._first_held_page(pages), self.tokens_per_page
        while n in pages:
            backed = self.geometry.tokens_in_member_pages(self._slices.backing(pages[n]))
            if backed < tpp:
                return n * tpp + backed
            n += 1
        return n * tpp

    def _expected_slice_mappings(self) -> dict:
        """{range page: pool page id} that the replica and the binding say is mapped."""
        expected, binding, m = {}, self._slices, self.geometry.num_members
        for slot, pages in enumerate(self._slot_pages):
            for pi, g in pages.items():
                assert (slot, pi) in binding.spots(g), f"slot {slot} page {pi} not a spot of {g}"
                for j in range(m):
                    base = self._first_page(j, slot, pi)
                    for i, s in enumerate(binding.slices(g)):
                        expected[base + i] = self._pool_pages[s * m + j]
        binding.check_integrity()
        return expected

    @property
    def bound_slices(self) -> int:
        return self._slices.bound_slices

    def backing(self, group: int) -> int:
        """Pages of each member of ``group`` backed now (a byte-mapped pool)."""
        return self._slices.backing(group)
