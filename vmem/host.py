"""HostDriver: real virtual memory on Linux through ctypes on libc.

    reserve        mmap(NULL, size, PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)
    create pages   one memfd per create_pages call, sized and fallocated up front;
                   page i is the byte range [i * page_bytes, (i + 1) * page_bytes) of it
    discard pages  fallocate(memfd, PUNCH_HOLE|KEEP_SIZE, offset, page): its blocks go back
    recreate       posix_fallocate of the same range: the same handle, reading zeros
    map            mmap(addr, page, PROT_READ|PROT_WRITE, MAP_SHARED|MAP_FIXED, memfd, offset)
    unmap          mmap(addr, page, PROT_NONE, MAP_FIXED|MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)
    free range     munmap(addr, size)
    detach         copy: the page's bytes copied into fresh anonymous memory, moved over addr
                   by mremap(MREMAP_FIXED) (one step: the address never shows anything else;
                   its memory checked by the caller first: VirtualRange.close's commit);
                   in a forked child, mmap(addr, page, PROT_READ|PROT_WRITE,
                   MAP_PRIVATE|MAP_FIXED, memfd, offset): copy-on-write, nothing copied
    tensor         a DLPack capsule naming the CPU (vmem/dlpack.py), zero copy

Unmapping replaces the page with a fresh PROT_NONE reservation rather than calling munmap, so the
address range stays ours (no other allocation can land in the hole) and touching it faults.
The driver keeps what CUDA's keeps (its reservations, what is mapped where, each page's size,
whether it is closed) and refuses what cuMemMap, cuMemUnmap and cuMemAddressFree refuse, before
any system call (vmem/host_records.py); a reserve or map that could take the process within
a margin of Linux's ``vm.max_map_count`` mappings is refused too, and so is a detach
(vmem/map_count.py: at the limit no page could be unmapped again); after ``close()`` it makes
nothing new (ClosedError) but still unmaps, frees and releases what was made with it, so
nothing leaks.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from typing import Sequence

from . import checks, commits, map_count
from .dlpack import DLPACK_CPU, tensor_at
from .driver import Driver
from .errors import ClosedError, DriverCallError, DriverUnavailableError, InsufficientMemoryError
from .host_records import HostPage, HostRecords, PageFiles, check_pages

# Linux values, identical on x86_64 and aarch64.
PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MREMAP_MAYMOVE, MREMAP_FIXED = 0x1, 0x2


def host_unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the host driver needs Linux (mmap/memfd), this is {sys.platform}"
    if not hasattr(os, "memfd_create"):
        return "this Python has no os.memfd_create"
    return None


def meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo in bytes ("MemAvailable", "MemTotal"), None when unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def address_space_left_bytes() -> int | None:
    """Bytes of address space this process may still map under its RLIMIT_AS (``ulimit -v``),
    None when unlimited or unreadable. Reservations count against it, memory or not."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration, ValueError):
        return None
    return max(0, soft - used)


RECORD_BYTES = 512    # a page's records on the host, any driver (tracemalloc: 280-350 bytes)


def check_pool_records(num_pages: int) -> None:
    """InsufficientMemoryError when a page pool's records alone (vmem/pool.py: ``RECORD_BYTES``
    a page, host memory on every driver) would not fit what the host has available."""
    need, available = num_pages * RECORD_BYTES, min(   # MemAvailable, and ulimit -v's bound
        (b for b in (meminfo_bytes("MemAvailable"), address_space_left_bytes()) if b is not None),
        default=None)
    if available is not None and need > available:
        raise InsufficientMemoryError(
            f"a pool of {num_pages} pages keeps about {need} bytes ({need / 2**30:.2f} GiB) of "
            f"records on the host ({RECORD_BYTES} a page) but only {available} bytes "
            f"({available / 2**30:.2f} GiB) are available; ask for fewer pages")


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                            ctypes.c_void_p]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


class HostDriver(Driver):
    """Virtual memory of this process, backed by memfd pools. Tensors live on the CPU."""

    name = "host"
    pages_in_host_memory = True

    def __init__(self) -> None:
        reason = host_unavailable_reason()
        if reason:
            raise DriverUnavailableError(reason)
        self._libc = _load_libc()
        self._page_size = os.sysconf("SC_PAGE_SIZE")
        self.recent_commits = commits.HOST      # one host memory, whichever driver commits
        self._records = HostRecords()
        self._files = PageFiles()               # memfds made and not released (host_records)
        self._lock = threading.RLock()          # the records and the calls that change them
        self._closed = False

    @property
    def granularity_bytes(self) -> int:
        return self._page_size

    @property
    def device(self) -> str:
        return "cpu"

    def available_bytes(self) -> int | None:
        """MemAvailable, or less when ``ulimit -v`` leaves less address space to map it in."""
        limits = [b for b in (meminfo_bytes("MemAvailable"), address_space_left_bytes())
                  if b is not None]
        return min(limits) if limits else None

    def _mmap(self, call: str, address: int | None, size: int, prot: int, flags: int,
              fd: int = -1, offset: int = 0) -> int:
        if call != "detach":
            self._check_not_forked()
        result = self._libc.mmap(address, size, prot, flags, fd, offset)
        if result in (None, MAP_FAILED):
            errno = ctypes.get_errno()
            raise DriverCallError(f"{call}: mmap({size} bytes) failed: "
                                  f"{os.strerror(errno)} (errno {errno})")
        if address is not None and result != address:  # MAP_FIXED guarantees this
            raise DriverCallError(f"{call}: mmap placed {result:#x}, asked for {address:#x}")
        return result

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this HostDriver is closed")

    def close(self) -> None:
        """Make nothing new from now on; what was made can still be given back."""
        self._closed = True

    def _after_fork_in_child(self) -> None:
        super()._after_fork_in_child()
        self._lock = threading.RLock()    # one another thread held at the fork stays held

    def reserve(self, size_bytes: int) -> int:
        size_bytes = self.check_bytes(size_bytes, "reserve size_bytes")
        self._check_open()
        with self._lock:
            map_count.GUARD.check("reserve", 1)
            address = self._mmap("reserve", None, size_bytes, PROT_NONE,
                                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
            self._records.reserved(address, size_bytes)
            return address

    def free_reservation(self, address: int, size_bytes: int) -> None:
        address = checks.as_int(address, "free_reservation address")
        size_bytes = self.check_bytes(size_bytes, "free_reservation size_bytes")
        with self._lock:
            self._records.check_free(address, size_bytes)
            if self._libc.munmap(address, size_bytes) != 0:
                errno = ctypes.get_errno()
                raise DriverCallError(f"free_reservation: munmap failed: {os.strerror(errno)}")
            self._records.freed(address)

    def create_pages(self, num_pages: int, page_bytes: int,
                     discarded: bool = False) -> Sequence[HostPage]:
        num_pages, page_bytes = self._check_pages(num_pages, page_bytes)
        self._check_open()
        self._check_not_forked()
        if not num_pages:            # no memfd: nothing could ever release it (CUDA: none)
            return []
        try:
            fd = os.memfd_create("vmemkv-pages", os.MFD_CLOEXEC)
        except OSError as error:     # EMFILE (ulimit -n), ENFILE, ENOMEM
            raise DriverCallError(f"create_pages: memfd_create failed: {error.strerror} "
                                  f"(errno {error.errno}; a file-descriptor limit, ulimit -n?)") from None
        try:                         # the memfd goes again on any failure, typed or not
            os.ftruncate(fd, num_pages * page_bytes)
            # Commit the whole budget now (shmem blocks), as cuMemCreate would: mapping
            # latency then never includes page creation, and an over-budget pool fails here.
            if not discarded:
                os.posix_fallocate(fd, 0, num_pages * page_bytes)
            with self._lock:
                file_id = self._files.created(fd)
            return [HostPage(fd, i * page_bytes, page_bytes, file_id) for i in range(num_pages)]
        except BaseException as error:
            os.close(fd)
            if isinstance(error, OSError):
                raise DriverCallError(f"create_pages: could not back {num_pages} pages of "
                                      f"{page_bytes} bytes: {error}") from None
            raise

    def release_pages(self, handles: Sequence[HostPage],
                      discarded: Sequence[HostPage] = ()) -> None:
        with self._lock:
            fds = self._files.released([*handles, *discarded])
        for fd in fds:
            os.close(fd)

    def discard_pages(self, handles: Sequence[HostPage], page_bytes: int) -> None:
        page_bytes = self.check_bytes(page_bytes)
        self._check_not_forked()
        with self._lock:
            handles = self._files.check_live("discard_pages", handles)
        for page in handles:
            self._punch(page, page_bytes)

    def _punch(self, page: HostPage, page_bytes: int) -> None:
        flags = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if self._libc.fallocate(page.fd, flags, page.offset_bytes, page_bytes) != 0:
            errno = ctypes.get_errno()
            raise DriverCallError(f"discard_pages: fallocate(PUNCH_HOLE, offset "
                                  f"{page.offset_bytes}, {page_bytes} bytes) failed: "
                                  f"{os.strerror(errno)} (errno {errno})")

    def recreate_pages(self, handles: Sequence[HostPage], page_bytes: int) -> Sequence[HostPage]:
        page_bytes = self.check_bytes(page_bytes)
        self._check_open()
        self._check_not_forked()
        with self._lock:
            handles = self._files.check_live("recreate_pages", handles)
        done: list[HostPage] = []
        try:
            for page in handles:
                os.posix_fallocate(page.fd, page.offset_bytes, page_bytes)
                done.append(page)
        except OSError as error:     # ENOSPC (tmpfs full), ENOMEM: all or nothing
            for page in done:
                self._punch(page, page_bytes)
            raise DriverCallError(f"recreate_pages: posix_fallocate of {page_bytes} bytes "
                                  f"failed: {error.strerror} (errno {error.errno})") from None
        return list(handles)

    def map(self, address: int, handle: HostPage, page_bytes: int) -> None:
        address = checks.as_int(address, "map address")
        page_bytes = self.check_bytes(page_bytes)
        self._check_open()
        with self._lock:
            self._files.check_live("map", [handle])
            if page_bytes > handle.page_bytes:
                raise DriverCallError(f"map({address:#x}, {page_bytes} bytes): the page holds "
                                      f"{handle.page_bytes} bytes (CUDA's cuMemMap refuses it "
                                      f"too)")
            self._records.check_map(address, page_bytes)
            map_count.GUARD.check("map", 2)     # itself, and the reservation split around it
            self._mmap("map", address, page_bytes, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, handle.fd, handle.offset_bytes)
            self._records.mapped(address, page_bytes)

    def unmap(self, address: int, page_bytes: int) -> None:
        address = checks.as_int(address, "unmap address")
        page_bytes = self.check_bytes(page_bytes)
        with self._lock:
            self._records.check_mapped("unmap", address, page_bytes)
            self._mmap("unmap", address, page_bytes, PROT_NONE,
                       MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
            self._records.unmapped(address, page_bytes)

    def unmap_if_mapped(self, address: int, page_bytes: int) -> bool:
        address = checks.as_int(address, "unmap_if_mapped address")
        with self._lock:      # the records know: no unmap of an address never mapped
            if not self._records.is_mapped(address, page_bytes):
                return False
            self.unmap(address, page_bytes)
            return True

    def detach(self, address: int, handle: HostPage, page_bytes: int, copy: bool = True) -> bool:
        address = checks.as_int(address, "detach address")
        page_bytes = self.check_bytes(page_bytes)
        with self._lock:
            if copy:                            # a copy needs only the address
                check_pages("detach", [handle])
            else:
                self._files.check_live("detach", [handle])
            self._records.check_mapped("detach", address, page_bytes)
            if not self._forked:    # a child's never: refused, it would share the parent's page
                # a copy is a mapping of its own (copies never merge): close() under a view
                # of n merged pages made n of them; refused, the page is held (vmem/vrange.py)
                map_count.GUARD.check("detach", 2)
            self._detach(address, handle, page_bytes, copy)
            self._records.unmapped(address, page_bytes)    # no mapping of a page any more
            return True

    def _detach(self, address: int, handle: HostPage, page_bytes: int, copy: bool) -> None:
        if not copy:
            self._mmap("detach", address, page_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_FIXED, handle.fd, handle.offset_bytes)
            return
        # A private mapping of the memfd would still show the page where it was never
        # written: the next owner's bytes, or zeros after a discard. So copy, then move.
        scratch = self._mmap("detach", None, page_bytes, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS)
        ctypes.memmove(scratch, address, page_bytes)
        moved = self._libc.mremap(scratch, page_bytes, page_bytes,
                                  MREMAP_MAYMOVE | MREMAP_FIXED, address)
        if moved != address:
            errno = ctypes.get_errno()
            self._libc.munmap(scratch, page_bytes)
            raise DriverCallError(f"detach: mremap({page_bytes} bytes) failed: "
                                  f"{os.strerror(errno)} (errno {errno})")

    def close_inherited(self, handles: Sequence[HostPage]) -> None:
        with self._lock:
            fds = self._files.forget(handles)
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def tensor(self, address: int, num_bytes: int, on_release=None):
        num_bytes = checks.check_count(num_bytes, "tensor takes num_bytes", most=checks.MAX_BYTES)
        self._check_not_forked()
        if num_bytes == 0:
            import torch
            return torch.empty(0, dtype=torch.uint8)
        return tensor_at(address, num_bytes, DLPACK_CPU, on_release=on_release)
