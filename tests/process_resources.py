"""What the host driver can leave behind in this process, read from the kernel, and counted so
that nothing else in the process moves the count: Python's and glibc's allocators map and unmap
anonymous memory whenever they like (an arena for a new thread, an obmalloc arena), so the total
number of lines of /proc/self/maps is not a leak detector (it moved by one in a CI run).

- memfd mappings: lines of /proc/self/maps naming the driver's memfds;
- memfd descriptors: entries of /proc/self/fd that link to one, and every descriptor;
- live reservations: the address ranges ``HostDriver.reserve`` returned while ``watch()`` was
  active that are still wholly mapped by us: by PROT_NONE reservation or by pages of our memfds.

The kernel merges adjacent mappings with the same flags into one line, and a reservation
(private, anonymous, PROT_NONE, MAP_NORESERVE) has exactly the flags of glibc's PROT_NONE heap
tails, so a reservation's line may start below its address (a CI run saw it). ``watch()``
therefore marks every reservation (and every page the driver unmaps back into one) with
MADV_DONTDUMP: marked mappings merge only with each other, and /proc/self/smaps shows the mark
("dd"), so a freed range that an allocator reuses is never taken for ours.
"""
from __future__ import annotations

import ctypes
import gc
import os
from contextlib import contextmanager
from typing import Iterator, List, NamedTuple, Tuple
from unittest import mock

from vmemkv.vmem.host import HostDriver, _load_libc

MEMFD_NAME = "memfd:vmemkv-pages"


class Resources(NamedTuple):
    memfd_mappings: int
    memfd_fds: int
    fds: int
    live_reservations: int


MADV_DONTDUMP = 16
_libc = _load_libc()
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def mark_ours(address: int, size_bytes: int) -> None:
    if _libc.madvise(address, size_bytes, MADV_DONTDUMP) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTDUMP) on a reservation failed")


def our_ranges() -> List[Tuple[int, int]]:
    """[start, end) of each run of adjacent mappings that are ours: a memfd page, or PROT_NONE
    anonymous memory that carries the mark."""
    runs: List[Tuple[int, int]] = []
    start = end = 0
    ours = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:   # a mapping's first line
                if ours:
                    runs.append((start, end))
                start, end = (int(x, 16) for x in head[0].split("-"))
                ours = MEMFD_NAME in line
                prot_none_anonymous = head[1] == "---p" and len(head) == 5
            elif head[0] == "VmFlags:" and prot_none_anonymous and "dd" in head[1:]:
                ours = True
    if ours:
        runs.append((start, end))
    merged: List[Tuple[int, int]] = []
    for start, end in runs:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


class Watch:
    def __init__(self) -> None:
        self.reserved: List[Tuple[int, int]] = []

    def snapshot(self, collect: bool = True) -> Resources:
        """What the process holds now; ``collect``: after the cycle collector has run (a
        dropped cache's finalizer releases its memory), else as reference counts left it."""
        if collect:
            gc.collect()
        with open("/proc/self/maps") as maps:
            memfd_mappings = sum(MEMFD_NAME in line for line in maps)
        fds = os.listdir("/proc/self/fd")
        memfd_fds = 0
        for fd in fds:
            try:
                memfd_fds += MEMFD_NAME in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:   # the descriptor listdir itself used, closed by now
                pass
        runs = our_ranges()
        live = sum(1 for address, size in self.reserved
                   if any(start <= address and address + size <= end for start, end in runs))
        return Resources(memfd_mappings, memfd_fds, len(fds), live)


@contextmanager
def watch() -> Iterator[Watch]:
    """Record and mark every reservation the host driver makes inside the block."""
    watcher = Watch()
    real_reserve, real_unmap = HostDriver.reserve, HostDriver.unmap

    def reserve(self, size_bytes: int) -> int:
        address = real_reserve(self, size_bytes)
        mark_ours(address, size_bytes)
        watcher.reserved.append((address, size_bytes))
        return address

    def unmap(self, address: int, page_bytes: int) -> None:
        real_unmap(self, address, page_bytes)
        mark_ours(address, page_bytes)

    with mock.patch.object(HostDriver, "reserve", reserve), \
            mock.patch.object(HostDriver, "unmap", unmap):
        yield watcher
