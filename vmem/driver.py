"""The driver interface: the few virtual-memory primitives both backends provide.

A driver is stateless bookkeeping-wise: it hands out raw addresses and physical-page handles
and never remembers what is mapped where (``PagePool`` and ``VirtualRange`` do). Addresses are
ints; sizes and offsets are bytes and must be multiples of ``granularity_bytes``, at most
``checks.MAX_BYTES`` (2**47), checked as ints before any system or CUDA call (``check_bytes``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence, TypeVar

from . import checks, commits, forks
from .errors import DriverUnavailableError, InsufficientMemoryError, VMemConfigError, VMemError

__all__ = ["Driver", "open_driver", "available_drivers", "check_driver"]
Made = TypeVar("Made")


class Driver(ABC):
    """Reserve address ranges, create physical pages, map and unmap them, view bytes as tensors.

    Guarantees: ``reserve`` costs no physical memory; touching an unmapped reserved address
    faults (never reads zeros); one physical page may be mapped at many addresses at once and
    every mapping shows the same bytes.
    """

    name: str = "abstract"
    pages_in_host_memory = False   # its pages and the pools' records share one memory (host)
    _forked = False          # set in a forked child (vmem/forks.py): page calls then refuse

    def __new__(cls, *args, **kwargs):
        driver = super().__new__(cls)
        # what this process committed lately that available_bytes() may not show yet: this
        # driver's own unless it shares a memory's (HostDriver, CudaDriver); tests put one
        # with their own clock here
        driver.recent_commits = commits.RecentCommits()
        forks.track_driver(driver)
        return driver

    @property
    @abstractmethod
    def granularity_bytes(self) -> int:
        """Smallest page size (and alignment) this driver maps."""

    @property
    @abstractmethod
    def device(self) -> str:
        """The torch device string tensors from ``tensor`` live on ("cpu", "cuda:0")."""

    @abstractmethod
    def reserve(self, size_bytes: int) -> int:
        """Reserve ``size_bytes`` of address space (no memory behind it); returns the address."""

    @abstractmethod
    def free_reservation(self, address: int, size_bytes: int) -> None:
        """Give back a reservation; nothing may be mapped in it any more."""

    @abstractmethod
    def create_pages(self, num_pages: int, page_bytes: int,
                     discarded: bool = False) -> Sequence[Any]:
        """Create ``num_pages`` physical pages up front; returns one opaque handle per page.
        ``discarded=True``: handles with no memory yet, as if ``discard_pages`` had been
        called on them (host: the memfd sized, nothing allocated; CUDA: placeholders)."""

    @abstractmethod
    def release_pages(self, handles: Sequence[Any], discarded: Sequence[Any] = ()) -> None:
        """Destroy pages made by one ``create_pages`` call (none may still be mapped).
        ``discarded``: that call's pages discarded since and not re-created; their memory is
        gone already, so only what the driver still holds for them goes (host: the memfd
        they share with ``handles``; CUDA: nothing, their handles are dead)."""

    @abstractmethod
    def discard_pages(self, handles: Sequence[Any], page_bytes: int) -> None:
        """Give back the physical memory of these ``page_bytes`` pages (mapped nowhere); their
        bytes are lost. On a failure part way, the pages before the failing one are discarded.
        A discarded handle goes only to ``recreate_pages``, or to ``release_pages`` as
        ``discarded``. Host: a hole punched in the memfd; CUDA: cuMemRelease."""

    @abstractmethod
    def recreate_pages(self, handles: Sequence[Any], page_bytes: int) -> Sequence[Any]:
        """Physical memory again for pages discarded before, all or nothing; returns the
        handles to use from now on, one per page in order (host: the same ones, reading
        zeros; CUDA: new ones from cuMemCreate, their bytes unspecified)."""

    @abstractmethod
    def map(self, address: int, handle: Any, page_bytes: int) -> None:
        """Map the physical page ``handle`` read/write at ``address``."""

    @abstractmethod
    def unmap(self, address: int, page_bytes: int) -> None:
        """Unmap ``page_bytes`` at ``address``; the addresses stay reserved and fault again."""

    def unmap_if_mapped(self, address: int, page_bytes: int) -> bool:
        """Unmap ``page_bytes`` at ``address`` when they are mapped: whether they were. Undoes a
        map an interrupt stopped before or after its driver call. Default: try, a refusal
        meaning nothing was there; the host driver asks its records instead, the CUDA driver
        takes only cuMemUnmap's refusal so (it changes nothing), never a failed synchronise."""
        try:
            self.unmap(address, page_bytes)
        except VMemError:
            return False
        return True

    def prepare_unmap(self, num_unmaps: int) -> None:
        """Called once per plan (per op group) before its ``num_unmaps`` unmaps on this thread:
        a driver whose unmap must wait for queued device work (CUDA) waits here once instead of
        per page. The caller guarantees no work queued after this call reads those pages.
        Default: nothing (the host driver's unmap never waits)."""

    @abstractmethod
    def tensor(self, address: int, num_bytes: int, on_release=None):
        """A zero-copy uint8 torch tensor over ``num_bytes`` at ``address``; ``on_release()``
        is called once when the last tensor sharing its storage dies (vmem/dlpack.py)."""

    def detach(self, address: int, handle: Any, page_bytes: int, copy: bool = True) -> bool:
        """Make the mapping of ``handle`` at ``address`` this process's own, readable and
        writable, never changing the pool page again: True when done, False when the driver
        cannot (default, and CUDA: the address still maps the pool page).
        ``copy=True`` (a view outliving its range): the page's bytes as they are now, in memory
        of the address's own, so what the pool page holds later never shows there (host: a
        copy moved over the address by one mremap). That memory is not checked here: the
        caller checks the copies first through ``commit`` (VirtualRange.close: all its pages
        as one commit, vmem/vrange.py). ``copy=False`` (a forked child, where
        copying every page would double the cache): copy-on-write, the pool page shows through
        until the address is written (host: a private mapping of the memfd page; a released
        ``handle``, whose memfd is gone, is refused: the child copies a page held after its
        pool closed)."""
        return False

    def close_inherited(self, handles: Sequence[Any]) -> None:
        """In a forked child: give back the child's copies of pages its parent created, never
        the parent's (host: close the child's copies of the memfds). Default: nothing (CUDA:
        no driver call can run in a child)."""

    def _after_fork_in_child(self) -> None:
        self._forked = True

    def _check_not_forked(self) -> None:
        if self._forked:
            raise forks.forked_error(f"{self.name} driver")

    def copy(self, dst_address: int, src_address: int, num_bytes: int) -> None:
        """Copy bytes between two mapped regions (used for copy-on-write)."""
        self.tensor(dst_address, num_bytes).copy_(self.tensor(src_address, num_bytes))

    def available_bytes(self) -> int | None:
        """Bytes of physical memory that pages could be created in now (host: MemAvailable;
        CUDA: the device's free memory), None when unknown. Pools check it before creating."""
        return None

    def commit(self, num_pages: int, page_bytes: int, create: Callable[[], Made],
               verb: str = "creating", records_bytes: int = 0) -> Made:
        """``create()`` (the driver call that commits ``num_pages`` pages of ``page_bytes``)
        once they fit in ``available_bytes()`` less ``recent_commits``' unseen bytes, else
        InsufficientMemoryError (every size in bytes) and nothing created; unchecked when the
        available memory is unknown. ``records_bytes``: host memory the caller builds with the
        pages (a pool's records), checked with them when the pages are host memory too
        (``pages_in_host_memory``: checked apart, pages taking 97% and records 7% both passed).
        Both go to ``recent_commits``: its reading's whole drop counts as its commits seen,
        and records (heap) show in MemAvailable at once, so left out they passed for pages seen
        while a memfd's lag hid the pages. A pool gives back only its pages' bytes there: its
        records (freed when it dies) count to the window's end, erring towards refusing.
        Reading, check and commit hold the process-wide commit lock (vmem/commits.py): two
        pools at once never both pass against the same memory."""
        records_bytes = records_bytes if self.pages_in_host_memory else 0
        need = num_pages * page_bytes + records_bytes
        with commits.LOCK:
            available = self.available_bytes()
            if available is not None:
                unseen = self.recent_commits.unseen(available)
                if need > available - unseen:
                    records = (f" ({need - records_bytes} bytes) and {records_bytes} bytes of "
                               f"records" if records_bytes else "")
                    raise InsufficientMemoryError(
                        f"{verb} {num_pages} pages of {page_bytes} bytes{records} needs {need} "
                        f"bytes ({need / 2**30:.2f} GiB) but the {self.name} driver reports "
                        f"only {available} bytes ({available / 2**30:.2f} GiB) available"
                        f"{_unseen_note(unseen, self.recent_commits.window_s)}; "
                        f"ask for fewer pages")
            made = create()
            if available is not None:
                self.recent_commits.committed(need, available)
            return made

    def close(self) -> None:
        """Release driver-wide resources (ranges and pools are closed by their owners)."""

    def check_bytes(self, value, name: str = "page_bytes") -> int:
        """``value`` as an int: a positive multiple of the granularity, at most
        ``checks.MAX_BYTES`` (VMemConfigError past it or not an int, AlignmentError off the
        granularity), the error naming ``name``. Every size a driver call takes is checked
        here before any system or CUDA call."""
        return checks.check_bytes(value, name, self.granularity_bytes, self.name)

    def _check_pages(self, num_pages, page_bytes) -> tuple[int, int]:
        """``create_pages``' arguments as ints: a count >= 0 and a page size (``check_bytes``),
        together at most ``checks.MAX_BYTES``."""
        num_pages = checks.check_count(num_pages, "create_pages takes num_pages")
        page_bytes = self.check_bytes(page_bytes)
        checks.check_ceiling(num_pages * page_bytes, f"create_pages of {num_pages} pages of "
                                                     f"{page_bytes} bytes:")
        return num_pages, page_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r}, granularity_bytes={self.granularity_bytes})"


def check_driver(driver, name: str = "driver", error: type = VMemConfigError) -> Driver:
    """``driver`` when it is an open ``Driver``, else ``error`` naming ``name``: a driver's name
    (``"host"``) failed deep inside as "'str' object has no attribute 'check_bytes'", and a
    falsy value (0) was read as "no driver given"."""
    if not isinstance(driver, Driver):
        hint = f": open it first, open_driver({driver!r})" if isinstance(driver, str) else ""
        raise error(f"{name} must be a vmem Driver (from open_driver('host' | 'cuda' | 'auto')), "
                    f"got {type(driver).__name__} {repr(driver)[:60]}{hint}")
    return driver


def _unseen_note(unseen: int, window_s: float) -> str:
    return (f", {unseen} bytes of it committed by this process in the last {window_s:g} s and "
            f"not shown yet") if unseen else ""


def open_driver(kind: str = "auto", device_index: int | None = None) -> Driver:
    """Open a driver: ``"host"`` (Linux mmap/memfd), ``"cuda"`` (CUDA VMM through cuda-python),
    or ``"auto"`` (cuda when a GPU and cuda-python are present and the device supports virtual
    memory management, else host). ``device_index``: the CUDA device (None: the current one),
    an int >= 0; ``"host"`` has no devices and refuses one (it was ignored, "x" included)."""
    if device_index is not None:
        device_index = checks.check_count(device_index, "open_driver takes device_index None "
                                                        "or an int")
        if kind == "host":
            raise VMemConfigError(f"open_driver('host') takes no device_index (the host driver "
                                  f"has no devices), got {device_index}; pass None")
    if kind == "host":
        from .host import HostDriver
        return HostDriver()
    if kind == "cuda":
        from .cuda import CudaDriver
        return CudaDriver(device_index)
    if kind == "auto":
        from .cuda import cuda_unavailable_reason
        if cuda_unavailable_reason() is None:
            try:
                return open_driver("cuda", device_index)
            except DriverUnavailableError:   # a GPU without VMM support
                pass
        return open_driver("host")
    raise VMemConfigError(f"unknown driver {kind!r}; choose one of 'auto', 'host', 'cuda'")


def available_drivers() -> dict[str, str | None]:
    """Driver name -> None when it can be opened here, else the reason it cannot."""
    from .cuda import cuda_unavailable_reason
    from .host import host_unavailable_reason
    return {"host": host_unavailable_reason(), "cuda": cuda_unavailable_reason()}
