"""VMemOps: how a bound vmem plan's ops become driver calls and copies, each inverse journaled.

Page index arithmetic (see vmem_cache's module docstring): member j of a page group under
(slot, page_index) spans the k = ``pages_per_member`` range pages from
``((j * max_batch + slot) * pages_per_slot + page_index) * k``, backed by pool pages
``group * pages_per_group + j * k ...``, where j = layer * 2 + kv (per-layer) or j = kv
(interleaved). A byte-mapped pool (members of k > 1 pages) backs them by slices instead
(vmem_slices). On a hybrid pool (``pool_pages``) the pool pages are the ones bound to the
member's part when the plan was bound (vmem_binding), handed to the application as the op's
payload: {part: pool pages} for a MapGroup, the parts it touches for an UnmapGroup/CopyGroup.
"""
from __future__ import annotations

from typing import Optional, Sequence

from vmemkv.scheduler.plan import CopyGroup, MapGroup, ReleaseGroup, SwapIn, SwapOut, UnmapGroup

from ..errors import CacheStateError
from .journal import PlanJournal
from .vmem_slices import SLICE_OPS

_PART_OPS = (MapGroup, UnmapGroup, CopyGroup)   # ops a hybrid plan binds to parts


class VMemOps:
    """Mixed into VMemKVCache: the replica update at bind time and the op application."""

    def _note_mappings(self, bound: Sequence, journal: PlanJournal) -> list:
        """Update the replica of what is mapped where, as of the end of the plan (in the step
        thread, so writes are checked against it before the mapper is done); undone with the
        plan if it fails. Returns the ops paired with what their application needs."""
        if self._binding is not None or self._slices is not None:
            return self._note_parts(bound, journal)
        for op, _ in bound:
            if isinstance(op, (MapGroup, UnmapGroup)):
                pages = self._slot_pages[op.slot]
                old = pages.get(op.page_index)
                if isinstance(op, MapGroup):
                    pages[op.page_index] = op.group
                else:
                    pages.pop(op.page_index, None)
                journal.replica_undo.append(lambda p=pages, i=op.page_index, o=old:
                                            p.pop(i, None) if o is None else p.__setitem__(i, o))
        return bound

    def _member_pages(self, member: int, slot: int, page_index: int, group: int = 0) -> list:
        """[(range page, pool page)] backing ``member`` of ``group`` mapped under (slot,
        page_index); per-layer: member j = layer * 2 + kv; interleaved: member j = kv."""
        k = self.geometry.pages_per_member
        first = self._first_page(member, slot, page_index)
        base = group * self.pages_per_group + member * k
        return [(first + i, base + i) for i in range(k)]

    def _first_page(self, member: int, slot: int, page_index: int) -> int:
        """Range page of member page 0 of what is mapped under (slot, page_index)."""
        return ((member * self.config.max_batch + slot) * self.pages_per_slot + page_index) * \
            self.geometry.pages_per_member

    def _map_pages(self, member: int, op: MapGroup, payload: dict) -> list:
        """[(range page, pool page)] a hybrid MapGroup maps for ``member``: the pages bound to
        the member's part, from the op's payload {part: pool pages}."""
        bound = payload[self._parts.part_of_layer[member // 2]]
        offset = self._parts.member_offset[member]
        return [(page_index, bound[offset + i]) for i, (page_index, _)
                in enumerate(self._member_pages(member, op.slot, op.page_index))]

    def _skips(self, op, payload, group: int) -> bool:
        """Whether a part-op (a hybrid MapGroup/UnmapGroup/CopyGroup; payload: its parts) leaves
        op group ``group`` (a layer) alone. Fixed-group ops have no payload: never."""
        return payload is not None and self._parts is not None and isinstance(op, _PART_OPS) \
            and self._parts.part_of_layer[group] not in payload

    def _apply_layer_group(self, bound: Sequence, group: int,
                           journal: Optional[PlanJournal] = None) -> None:
        """Apply the part of a plan (ops paired with swap buffers or part payloads) that
        touches op group ``group``, recording the inverse of every primitive in ``journal``."""
        journal = journal if journal is not None else PlanJournal({})
        rng = self.range
        # one device synchronise for every page this group unmaps, not one per page
        members = self.geometry.members_of(group)
        if self._slices is not None:
            self.driver.prepare_unmap(sum(self._slice_unmaps(op, payload, len(members))
                                          for op, payload in bound))
        else:
            unmaps = sum(isinstance(op, UnmapGroup) and not self._skips(op, payload, group)
                         for op, payload in bound)
            self.driver.prepare_unmap(unmaps * len(members) * self.geometry.pages_per_member)
        for index, (op, buffer) in enumerate(bound):
            journal.op_index = index
            if self._skips(op, buffer, group):
                continue
            if self._slices is not None and isinstance(op, SLICE_OPS):
                self._apply_slice_op(op, buffer, members, journal)
            elif isinstance(op, MapGroup):
                for j in self.geometry.members_of(group):
                    pages = self._member_pages(j, op.slot, op.page_index, op.group) \
                        if buffer is None else self._map_pages(j, op, buffer)
                    for page_index, pool_page in pages:
                        rng.map(page_index, self._pool_pages[pool_page])
                        journal.add(lambda pi=page_index: rng.unmap(pi))
            elif isinstance(op, UnmapGroup):
                for j in self.geometry.members_of(group):
                    for page_index, _ in self._member_pages(j, op.slot, op.page_index):
                        page_id = rng.unmap(page_index)
                        journal.add(lambda pi=page_index, pid=page_id: rng.map(pi, pid))
            elif isinstance(op, CopyGroup):
                for j in self.geometry.members_of(group):
                    dst_pages = self._member_pages(j, op.dst_slot, op.dst_page_index)
                    src_pages = self._member_pages(j, op.src_slot, op.src_page_index)
                    for (dst, _), (src_page, _) in zip(dst_pages, src_pages):
                        self._save_bytes(journal, dst * self.page_bytes, self.page_bytes)
                        rng.copy_page(dst, src_page)
            elif isinstance(op, SwapOut):
                for layer in self.geometry.layers_of(group):  # buffer: (layers, 2, tokens, heads, dim)
                    self._swap_copy(buffer[layer, 0], self._k[layer][op.slot, :op.num_tokens])
                    self._swap_copy(buffer[layer, 1], self._v[layer][op.slot, :op.num_tokens])
            elif isinstance(op, SwapIn):
                for layer in self.geometry.layers_of(group):
                    for cache in (self._k[layer], self._v[layer]):
                        target = cache[op.slot, :op.num_tokens]
                        saved = target.clone()
                        journal.add(lambda t=target, s=saved: t.copy_(s))
                    self._swap_copy(self._k[layer][op.slot, :op.num_tokens], buffer[layer, 0])
                    self._swap_copy(self._v[layer][op.slot, :op.num_tokens], buffer[layer, 1])
            elif not isinstance(op, ReleaseGroup):   # bookkeeping only: done at bind time
                raise CacheStateError(f"VMemKVCache cannot execute {op!r}")

    def _save_bytes(self, journal: PlanJournal, offset: int, num_bytes: int) -> None:
        """Keep a copy of bytes about to be overwritten; undo writes them back."""
        view = self.range.tensor(offset, num_bytes)
        saved = view.clone()
        journal.add(lambda: self.range.tensor(offset, num_bytes).copy_(saved))
