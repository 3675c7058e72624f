"""What the host driver remembers so that it refuses what CUDA VMM refuses.

mmap takes nearly anything, so CPU tests passed where the GPU fails; cuMemMap, cuMemUnmap and
cuMemAddressFree check against what the CUDA driver keeps, and so does the host driver now:

    map where a mapping is             MAP_FIXED replaced it          cuMemMap refuses
    map outside every reservation      replaced someone's memory      cuMemMap refuses
    map more bytes than the handle     mapped past the page           cuMemMap refuses
    unmap where nothing is mapped      made it PROT_NONE              cuMemUnmap refuses
    free a reservation, another size   unmapped part of it            cuMemAddressFree refuses

Each is a DriverCallError, as CudaDriver raises, before any system call. A mapping is
unmapped whole (address and size as mapped).

Overlap, in O(1) for a range's pages (every mapping of one size at a multiple of it from its
reservation's base: a new one on that grid overlaps only one that starts where it starts), by a
scan of the reservation's mappings otherwise (mixed sizes: only direct driver callers).
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Optional

from .errors import DriverCallError


class _Reservation:
    """One reservation: its base and size, and its mappings, address -> bytes."""

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size
        self.maps: Dict[int, int] = {}
        self.grid: Optional[int] = 0       # 0: nothing mapped; None: no common grid

    def overlap(self, address: int, size: int) -> Optional[int]:
        """The start of a mapping that overlaps [address, address + size), or None."""
        if address in self.maps:
            return address
        if self.grid == 0 or (self.grid == size and (address - self.base) % size == 0):
            return None
        return next((start for start, length in self.maps.items()
                     if start < address + size and address < start + length), None)

    def add(self, address: int, size: int) -> None:
        on_grid = (address - self.base) % size == 0
        if not self.maps:
            self.grid = size if on_grid else None
        elif self.grid != size or not on_grid:
            self.grid = None
        self.maps[address] = size

    def remove(self, address: int) -> None:
        del self.maps[address]
        if not self.maps:
            self.grid = 0


class HostRecords:
    """A host driver's reservations and mappings. Not thread-safe: the driver locks."""

    def __init__(self) -> None:
        self._bases: List[int] = []                  # sorted
        self._reservations: Dict[int, _Reservation] = {}

    def reserved(self, base: int, size: int) -> None:
        bisect.insort(self._bases, base)
        self._reservations[base] = _Reservation(base, size)

    def check_free(self, base: int, size: int) -> None:
        found = self._reservations.get(base)
        if found is None or found.size != size:
            held = "no reservation starts there" if found is None else \
                f"the reservation there is {found.size} bytes"
            raise DriverCallError(f"free_reservation({base:#x}, {size} bytes): {held} (CUDA's "
                                  f"cuMemAddressFree refuses it too)")

    def freed(self, base: int) -> None:
        del self._reservations[base]
        self._bases.pop(bisect.bisect_left(self._bases, base))

    def check_map(self, address: int, size: int) -> None:
        where = self._holding(address, size)
        if where is None:
            raise DriverCallError(f"map({address:#x}, {size} bytes): outside every reservation "
                                  f"of this driver (CUDA's cuMemMap refuses it too)")
        start = where.overlap(address, size)
        if start is not None:
            raise DriverCallError(f"map({address:#x}, {size} bytes): {where.maps[start]} bytes "
                                  f"are mapped at {start:#x} already; unmap first (CUDA's "
                                  f"cuMemMap refuses it too)")

    def mapped(self, address: int, size: int) -> None:
        self._holding(address, size).add(address, size)

    def is_mapped(self, address: int, size: int) -> bool:
        """Whether one mapping of exactly ``size`` bytes starts at ``address``."""
        where = self._holding(address, size)
        return where is not None and where.maps.get(address) == size

    def check_mapped(self, call: str, address: int, size: int) -> None:
        if not self.is_mapped(address, size):
            raise DriverCallError(f"{call}({address:#x}, {size} bytes): no mapping of {size} "
                                  f"bytes starts there (CUDA's cuMemUnmap refuses it too)")

    def unmapped(self, address: int, size: int) -> None:
        self._holding(address, size).remove(address)

    def _holding(self, address: int, size: int) -> Optional[_Reservation]:
        """The reservation [address, address + size) lies in, or None."""
        at = bisect.bisect_right(self._bases, address) - 1
        if at < 0:
            return None
        found = self._reservations[self._bases[at]]
        return found if address + size <= found.base + found.size else None
