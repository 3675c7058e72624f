"""Giving back the units wholly behind a sliding window (docs/models.md, "Sliding-window and
hybrid models"): vmem page groups and paged blocks whose every layer has a window. The widest
window W bounds them all; the next step's earliest query of a sequence is at ``computed``, which
reads keys from ``computed - W + 1`` on (runtime.attention.views.window_starts):

    slot s:  | g0 | g1 | g2 | g3 | g4 | g5 |          computed = 5.5 pages, W = 2 pages
               ^^^^^^^^^^^^^         ^-- first key read: computed - W + 1
               wholly behind: unheld (vmem: and unmapped, UnmapExtent), ``units[pi] = None``

Dropped units are a prefix of the sequence's unit list; the last unit always stays (growth and
copy-on-write work on it). A unit goes back once nobody else holds or maps it, and with it its
prefix registration (hits match from the first unit, so nothing after it hits either). A
sequence with dropped units is recomputed, never swapped (``WindowSwapError``). Hybrids: vmem
per-layer releases only the windowed kind (vmem_kinds.py, its frontier instead of the drop
below), interleaved keeps every unit, paged gives back its windowed block groups. The give-back
itself is UnitOps' (units.py: ``release_behind_window``); this module holds its error and the
reading of a dropped prefix.
"""
from __future__ import annotations

from ..errors import SchedulerError
from .prefix import HeldSeq


class WindowSwapError(SchedulerError, ValueError):
    """``swap_out`` of a sequence that gave back groups behind its window (its swap copy would
    read unmapped memory); ``can_swap_out`` is False for it, so the scheduler recomputes it."""


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
