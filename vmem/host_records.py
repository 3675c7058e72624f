"""What the host driver remembers so that it refuses what CUDA VMM refuses.

mmap takes nearly anything, so CPU tests passed where the GPU fails; cuMemMap, cuMemUnmap and
cuMemAddressFree check against what the CUDA driver keeps, and so does the host driver now:

    map where a mapping is             MAP_FIXED replaced it          cuMemMap refuses
    map outside every reservation      replaced someone's memory      cuMemMap refuses
    map more bytes than the handle     mapped past the page           cuMemMap refuses
    unmap where nothing is mapped      made it PROT_NONE              cuMemUnmap refuses
    free a reservation, another size   unmapped part of it            cuMemAddressFree refuses

Each is a DriverCallError, as CudaDriver raises, before any system call. A mapping is
unmapped whole (address and size as mapped). And the page files (``PageFiles``):

    a released page used again         its fd number named the next   cuMemMap, cuMemRelease
    (map, discard, re-create, detach,  create_pages' memfd: a map     refuse a released
    release twice)                     showed another pool's bytes,   handle
                                       a discard punched its pages,
                                       a release closed its file

Overlap, in O(1) for a range's pages (every mapping of one size at a multiple of it from its
reservation's base: a new one on that grid overlaps only one that starts where it starts), by a
scan of the reservation's mappings otherwise (mixed sizes: only direct driver callers).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set

from .errors import DriverCallError, VMemConfigError


@dataclass(frozen=True)
class HostPage:
    """A physical page: a page-sized byte range of a memfd; ``file_id`` names the
    ``create_pages`` call that made the memfd (its fd number is reused once it is closed)."""
    fd: int
    offset_bytes: int
    page_bytes: int
    file_id: int


def check_pages(call: str, handles: Iterable) -> list:
    """``handles`` as a list, VMemConfigError naming ``call`` unless each is a ``HostPage``
    (another value failed deep inside as an AttributeError on ``.fd``)."""
    handles = list(handles)
    for handle in handles:
        if not isinstance(handle, HostPage):
            raise VMemConfigError(f"{call} takes page handles from HostDriver.create_pages "
                                  f"(HostPage), got {type(handle).__name__} {repr(handle)[:60]}")
    return handles


class PageFiles:
    """The memfds a host driver created and has not released: file id -> fd. Not thread-safe:
    the driver locks."""

    def __init__(self) -> None:
        self._fds: Dict[int, int] = {}
        self._ids = itertools.count(1)

    def created(self, fd: int) -> int:
        """Record a new memfd; returns the file id its pages carry."""
        file_id = next(self._ids)
        self._fds[file_id] = fd
        return file_id

    def check_live(self, call: str, handles: Iterable) -> list:
        """``check_pages``, and DriverCallError naming ``call`` when one's memfd was released
        (module docstring), before any system call; returns the handles as a list."""
        handles = check_pages(call, handles)
        for handle in handles:
            if self._fds.get(handle.file_id) != handle.fd:
                raise DriverCallError(f"{call}: the page at offset {handle.offset_bytes} of "
                                      f"memfd {handle.fd} was released, or never made by this "
                                      f"driver (CUDA's cuMemMap and cuMemRelease refuse a "
                                      f"released handle too)")
        return handles

    def released(self, handles: Iterable) -> Set[int]:
        """Forget the memfds of ``handles`` (checked live first, all or none); returns their
        fds, for the caller to close."""
        handles = self.check_live("release_pages", handles)
        return {self._fds.pop(file_id) for file_id in {page.file_id for page in handles}}

    def forget(self, handles: Sequence) -> Set[int]:
        """The fds of ``handles``' memfds still recorded, forgotten unchecked (a forked child
        closing its copies)."""
        ids = {page.file_id for page in handles if isinstance(page, HostPage)}
        return {self._fds.pop(file_id) for file_id in ids if file_id in self._fds}


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
