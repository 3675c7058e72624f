"""What the host driver can leave behind in this process, read from the kernel, and counted so
that nothing else in the process moves the count: Python's and glibc's allocators map and unmap
anonymous memory whenever they like (an arena for a new thread, an obmalloc arena), so the total
number of lines of /proc/self/maps is not a leak detector (it moved by one in a CI run).

- memfd mappings: lines of /proc/self/maps naming the driver's memfds;
- memfd descriptors: entries of /proc/self/fd that link to one, and every descriptor;
- live reservations: the address ranges ``HostDriver.reserve`` returned while ``watch()`` was
  active that are still mapped at exactly that address and size (reserved PROT_NONE, or with
  pages mapped under them).
"""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from typing import Iterator, List, NamedTuple, Tuple
from unittest import mock

from vmemkv.vmem.host import HostDriver

MEMFD_NAME = "memfd:vmemkv-pages"


class Resources(NamedTuple):
    memfd_mappings: int
    memfd_fds: int
    fds: int
    live_reservations: int


class Watch:
    def __init__(self) -> None:
        self.reserved: List[Tuple[int, int]] = []

    def snapshot(self) -> Resources:
        gc.collect()   # a dropped cache's finalizer releases its memory
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
        starts = {}
        memfd_mappings = 0
        for line in lines:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ours = MEMFD_NAME in line or (fields[1] == "---p" and len(fields) == 5)
            if ours:   # a freed range's address reused by an allocator's rw-p arena is not ours
                starts[start] = end
            memfd_mappings += MEMFD_NAME in line
        fds = os.listdir("/proc/self/fd")
        memfd_fds = 0
        for fd in fds:
            try:
                memfd_fds += MEMFD_NAME in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:   # the descriptor listdir itself used, closed by now
                pass
        # a reservation with pages mapped under it splits into several lines; its first line
        # still starts at the reserved address, PROT_NONE or one of our memfds
        live = sum(1 for address, size in self.reserved
                   if address in starts and starts[address] - address <= size)
        return Resources(memfd_mappings, memfd_fds, len(fds), live)


@contextmanager
def watch() -> Iterator[Watch]:
    """Record every reservation the host driver makes inside the block."""
    watcher = Watch()
    real_reserve = HostDriver.reserve

    def reserve(self, size_bytes: int) -> int:
        address = real_reserve(self, size_bytes)
        watcher.reserved.append((address, size_bytes))
        return address

    with mock.patch.object(HostDriver, "reserve", reserve):
        yield watcher
