"""Giving back the units wholly behind a sliding window (docs/models.md, "Sliding-window and
hybrid models"): vmem page groups and paged blocks whose every layer has a window. The widest
window W bounds them all; the next step's earliest query of a sequence is at ``computed``, which
reads keys from ``computed - W + 1`` on (runtime.attention.base.window_starts):

    slot s:  | g0 | g1 | g2 | g3 | g4 | g5 |          computed = 5.5 pages, W = 2 pages
               ^^^^^^^^^^^^^         ^-- first key read: computed - W + 1
               wholly behind: unheld (vmem: and unmapped, UnmapExtent), ``units[pi] = None``

Dropped units are a prefix of the sequence's unit list; the last unit always stays (growth and
copy-on-write work on it). A unit goes back once nobody else holds or maps it, and with it its
prefix registration (hits match from the first unit, so nothing after it hits either). A
sequence with dropped units is recomputed, never swapped (``WindowSwapError``). Hybrids: vmem
per-layer releases only the windowed kind (vmem_kinds.py, its frontier instead of the drop
below), interleaved keeps every unit, paged gives back its windowed block groups.
"""
from __future__ import annotations

from typing import Optional

from ..errors import SchedulerError
from .prefix import HeldSeq


class WindowSwapError(SchedulerError, ValueError):
    """``swap_out`` of a sequence that gave back groups behind its window (its swap copy would
    read unmapped memory); ``can_swap_out`` is False for it, so the scheduler recomputes it."""


class WindowedGroups:
    """Mixed into VmemManager and PagedManager: ``window_tokens``, ``release_behind_window``
    and the swap refusal; each manager says how a unit is given back (``_give_back``)."""

    _window: Optional[int] = None

    def _init_window(self, window_tokens: Optional[int]) -> None:
        self._window = window_tokens

    @property
    def window_tokens(self) -> Optional[int]:
        return self._window

    def release_behind_window(self, seq_id: int, computed_tokens: int) -> None:
        """Unhold and unmap the sequence's groups wholly before ``computed_tokens - W + 1``."""
        if self._window is None:
            return
        seq = self._changing(seq_id)
        for units, window in self._windowed_tables(seq):
            first_read = computed_tokens - window + 1
            # the last unit always stays: growth and copy-on-write work on it
            behind = min(max(first_read, 0) // self.unit_tokens, len(units) - 1)
            first = behind             # dropped units are a prefix: walk back to its end only,
            while first > 0 and units[first - 1] is not None:   # O(units newly dropped)
                first -= 1
            for pi in range(first, behind):
                self._drop_unit(seq, units, pi)

    def _windowed_tables(self, seq: HeldSeq) -> tuple:
        """(units, window tokens) of every table of ``seq`` that gives back behind a window:
        its one unit list here; a paged hybrid's windowed block groups (paged.py)."""
        return ((seq.units, self._window),)

    def _drop_unit(self, seq: HeldSeq, units: list, pi: int) -> None:
        unit = units[pi]
        units[pi] = None
        self._unhold(unit)
        self._cap_sum -= self.unit_tokens
        self._tok_sum -= self.unit_tokens      # a unit behind the window is full
        self._give_back(seq, pi, unit)

    def _give_back(self, seq: HeldSeq, pi: int, unit: int) -> None:
        """After ``unit`` (index ``pi`` of ``seq``) is unheld: the manager's own release."""

    def _window_dropped(self, seq: HeldSeq) -> int:
        """Leading units whose memory (or, hybrid, windowed part) ``seq`` gave back."""
        return dropped_units(seq)

    def can_swap_out(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is not None and self._window_dropped(seq):
            return False
        return super().can_swap_out(seq_id)

    def swap_out(self, seq_id: int) -> int:
        seq = self._seq(seq_id)
        if self._window_dropped(seq):
            raise WindowSwapError(
                f"sequence {seq_id} gave back {self._window_dropped(seq)} page groups behind its "
                f"{self._window}-token window and cannot be swapped out; preempt it by recompute")
        return super().swap_out(seq_id)


def dropped_units(seq: HeldSeq) -> int:
    """Leading units of ``seq`` given back behind its window."""
    return dropped_in(seq.units)


def dropped_in(units: list) -> int:
    """Leading entries of a unit list (or block table) given back behind a window (None)."""
    n = 0
    for unit in units:
        if unit is not None:
            break
        n += 1
    return n


def held_units(seq: HeldSeq) -> list:
    """The units ``seq`` still holds (its list without the dropped prefix)."""
    return seq.units[dropped_units(seq):]
