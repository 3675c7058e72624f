"""PartOps: the hybrid (part-bound pool) side of VMemKVCache: binding plans, guarding reads.

A hybrid cache (``VMemKVCache(..., pool_pages=N)``) executes part-ops: MapGroup / UnmapGroup /
ReleaseGroup of one part (FULL: the full-attention layers' members, WINDOW: the windowed
layers') or both ("all"). When a plan is bound (step thread), every op is checked and applied
to the PartBinding in plan order, so a refused op (mapping a spot twice, past the pool,
releasing a part still mapped, swapping or copying a sequence whose window part is gone)
raises CacheStateError with nothing changed, and the background mapper's per-layer
application only reads each op's resolved payload. A step or read that would touch a member
whose part is unmapped is refused, never performed.
"""
from __future__ import annotations

from typing import Sequence

from vmemkv.scheduler.geometry import PageGeometry

from vmemkv.runtime.attention.base import window_starts
from vmemkv.scheduler.plan import (CopyGroup, GroupPart, MapGroup, ReleaseGroup, ResizeGroup, SwapIn,
                                   SwapOut, UnmapGroup)

from ..config import CacheConfig
from ..errors import CacheConfigError, CacheStateError
from .journal import PlanJournal
from .vmem_binding import PARTS, PartBinding, PartLayout


class PartOps:
    """Mixed into VMemKVCache; used only when ``self._binding`` is set (a hybrid pool)."""

    @staticmethod
    def _part_binding(config: CacheConfig, geometry: PageGeometry, pool_pages) -> tuple:
        """(PartLayout, PartBinding) of a hybrid pool, (None, None) without ``pool_pages``."""
        if pool_pages is None:
            return None, None
        if isinstance(pool_pages, bool) or not isinstance(pool_pages, int) or pool_pages < 1:
            raise CacheConfigError(f"pool_pages must be None or an int >= 1, got {pool_pages!r}")
        layout = PartLayout(geometry, config.layer_windows)
        return layout, PartBinding(layout, pool_pages)

    @property
    def bound_pages(self) -> int:
        """Pool pages backing page groups now: bound to a part (hybrid), or every pool page
        (fixed pages per group)."""
        return self._binding.bound_pages if self._binding is not None else self.pool.total_pages

    def mapped_parts(self, slot: int) -> dict:
        """{page_index: {part: group}} mapped under ``slot`` (a hybrid pool; otherwise every
        mapped group is mapped whole, as part "all")."""
        if self._binding is None:
            return {pi: {GroupPart.ALL: g} for pi, g in self._slot_pages[slot].items()}
        return {pi: self._binding.parts_at(slot, pi) for pi in self._slot_pages[slot]}

    def _check_part_op(self, index: int, op) -> None:
        """A cache of fixed pages per group executes whole-group ops only; ResizeGroup runs on
        a byte-mapped pool only (vmem_slices)."""
        if self._binding is None and (isinstance(op, ReleaseGroup) or isinstance(
                op, (MapGroup, UnmapGroup)) and op.part != GroupPart.ALL):
            raise CacheStateError(f"op {index} of the plan is a part-op for a hybrid pool "
                                  f"(pool_pages); this cache maps whole groups: {op!r}")
        if self._slices is None and isinstance(op, ResizeGroup):
            raise CacheStateError(f"op {index} of the plan resizes a group of a byte-mapped pool "
                                  f"(members of k > 1 pages); this cache has fixed groups: {op!r}")

    def _note_parts(self, bound: Sequence, journal: PlanJournal) -> list:
        """Bind every op of the plan, in order (a hybrid pool's parts, or a byte-mapped pool's
        slices); all or nothing (CacheStateError naming the op)."""
        undo, out = journal.replica_undo.append, []
        bind = self._bind_part_op if self._binding is not None else self._bind_slice_op
        try:
            for op, payload in bound:
                out.append((op, bind(op, payload, undo)))
        except CacheStateError as error:
            for action in reversed(journal.replica_undo):
                action()
            journal.replica_undo.clear()
            self._swapped = journal.swapped_before
            raise CacheStateError(f"plan refused at op {len(out)}, nothing changed: {error}") from None
        return out

    def _bind_part_op(self, op, buffer, undo):
        """The payload op ``op`` is applied with (see vmem_ops), after updating the binding."""
        binding = self._binding
        if isinstance(op, MapGroup):
            if not 0 <= op.group < self.num_groups:
                raise CacheStateError(f"MapGroup names group {op.group}, outside 0..{self.num_groups - 1}")
            payload = binding.map(op.slot, op.page_index, op.group, op.part, undo)
            self._sync_slot(op.slot, op.page_index, undo)
            return payload
        if isinstance(op, UnmapGroup):
            parts = binding.unmap(op.slot, op.page_index, op.group, op.part, undo)
            self._sync_slot(op.slot, op.page_index, undo)
            return parts
        if isinstance(op, ReleaseGroup):
            binding.release(op.group, op.part, undo)
            return None
        if isinstance(op, CopyGroup):
            dst = binding.parts_at(op.dst_slot, op.dst_page_index)
            src = binding.parts_at(op.src_slot, op.src_page_index)
            if not dst or set(dst) - set(src):
                raise CacheStateError(f"{op!r}: parts {sorted(dst)} are mapped at the destination, "
                                      f"{sorted(src)} at the source; both need the destination's")
            return tuple(dst)
        if isinstance(op, (SwapOut, SwapIn)):
            self._check_whole(op.slot, op.num_tokens, f"{type(op).__name__} of sequence {op.seq_id}")
        return buffer

    def _sync_slot(self, slot: int, page_index: int, undo) -> None:
        """The slot replica ({page index: group}, any part mapped) follows the binding."""
        pages = self._slot_pages[slot]
        old = pages.get(page_index)
        groups = set(self._binding.parts_at(slot, page_index).values())
        if groups:
            pages[page_index] = groups.pop()
        else:
            pages.pop(page_index, None)
        undo(lambda: pages.pop(page_index, None) if old is None else pages.__setitem__(page_index, old))

    def _check_whole(self, slot: int, num_tokens: int, what: str) -> None:
        """Every page of the first ``num_tokens`` tokens of ``slot`` has both parts mapped."""
        for page_index in range(self.geometry.pages_for(num_tokens)):
            missing = [p for p in PARTS if not self._binding.has(slot, page_index, p)]
            if missing:
                raise CacheStateError(f"{what} touches tokens of slot {slot} at page {page_index} "
                                      f"whose {missing[0]!r} part is not mapped")

    def _check_part_reads(self, step, slots: tuple) -> None:
        """Every key a layer reads this step, and every token written, is mapped: the full
        layers' part from token 0, the windowed layers' part from the (widest) window start."""
        tpp, binding = self.tokens_per_page, self._binding
        starts = window_starts(step.lens, self._parts.window_tokens)
        for seq_id, slot, start, end in zip(step.seq_ids, slots, starts, step.lens.context_lens):
            for page_index in range(self.geometry.pages_for(end)):
                parts = PARTS if (page_index + 1) * tpp > start else (GroupPart.FULL,)
                for part in parts:
                    if not binding.has(slot, page_index, part):
                        raise CacheStateError(
                            f"sequence {seq_id}: this step reads its {part!r} layers' tokens "
                            f"{page_index * tpp}..{(page_index + 1) * tpp - 1} but that part of "
                            f"page {page_index} is not mapped (given back behind the window?)")

    def _check_part_read(self, seq_id: int, slot: int, layer: int, num_tokens: int) -> None:
        part = self._parts.part_of_layer[layer]
        for page_index in range(self.geometry.pages_for(num_tokens)):
            if not self._binding.has(slot, page_index, part):
                raise CacheStateError(f"sequence {seq_id}: layer {layer} ({part!r} part) has no "
                                      f"memory mapped at page {page_index}; it cannot be read")

    def _expected_part_mappings(self) -> dict:
        """{range page: pool page id} that the binding says is mapped."""
        expected, binding = {}, self._binding
        for (slot, page_index), parts in binding.mapped_spots().items():
            assert self._slot_pages[slot].get(page_index) in parts.values(), \
                f"slot replica of slot {slot} page {page_index}"
            for part, group in parts.items():
                payload = {part: binding.pages(group, part)}
                op = MapGroup(slot, page_index, group, part)
                for layer in self._parts.layers[part]:
                    for j in (2 * layer, 2 * layer + 1):
                        for range_page, pool_page in self._map_pages(j, op, payload):
                            expected[range_page] = self._pool_pages[pool_page]
        spots = sum(len(pages) for pages in self._slot_pages)
        assert spots == len(binding.mapped_spots()), "slot replica holds spots the binding lacks"
        binding.check_integrity()
        return expected
