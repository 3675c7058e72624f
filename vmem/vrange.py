"""VirtualRange: a reserved, contiguous address range with physical pages mapped on demand.

    address                                            address + size_bytes
    |  page 0  |  page 1  |  page 2  |  ...  | page num_pages-1 |
       mapped    PROT_NONE   mapped               PROT_NONE
       (pool p3) (faults)    (pool p3 again: same bytes as page 0)

Page ``i`` covers bytes [i * page_bytes, (i + 1) * page_bytes). The range remembers which pool
page is mapped at each index; pools count mappings. Tensor views are zero copy; reading a page
that is not mapped faults (a caller bug), as it should.

A view may outlive the range. The range counts its live views (each view's storage
finalizer tells it when the last tensor on that storage dies, vmem/dlpack.py); ``close()`` with views
alive *retires* it: the address range stays reserved and each mapped page stays readable until
the last view dies, then the reservation is freed. So a tensor read after ``close()`` sees the
bytes it held, never a segfault, and never what the pool page holds for its next owner, nor the
zeros of a discard. Each mapped page is either

    copied    (host) its bytes copied into memory of the address's own, moved over it; the pool
              page goes back to the pool's counts at once. The copies (mapped pages x
              page_bytes) are checked first, all together, as one commit (``Driver.commit``:
              refused when the memory is not available, recorded in ``RecentCommits`` when it
              is), so close() never commits memory the device does not have
    held      when the copies do not fit, a copy fails (two in a row: the rest too, untried), or
              the driver cannot detach (CUDA): the view keeps showing the pool page, costing no
              new memory, and the page is frozen for it until its last view dies: mapping it
              anywhere or discarding it is refused (PageStateError naming the view),
              ``pool.release`` parks it (flagged free, off the free list: no next owner;
              ``pool.held_pages`` counts it), a pool closed meanwhile destroys it (its memory
              goes with the view's mapping); when the last view dies it is unmapped and, if
              released, listed free

Holding, not refusing ``close()`` with InsufficientMemoryError: a close that raised would leave
its caller (a cache's ``close()``, ``__exit__``) half done with nothing to do but drop its
views, and on CUDA, which cannot detach, every close under a view would be refused.
Threads: the pool's lock guards every call (vmem/pool.py). A view's release never waits for
it: the collector runs releases inside any call (``Driver.commit`` holding the commit lock, a
host driver call holding its lock) while the pool lock's holder may wait for that lock (a hang).
A view dying while another thread holds the pool's lock, or inside a call on its own thread (the
collector), is queued on that lock (``commits.DrainingLock``): counted, and its retired range
freed, as the call holding it returns, never in its middle. Fork: vmem/forks.py.
"""
from __future__ import annotations

from contextlib import suppress
from typing import List

from . import forks
from .checks import MAX_BYTES, as_int, check_index
from .errors import (AlignmentError, AlreadyMappedError, ClosedError, InsufficientMemoryError,
                     NotMappedError, PageIndexError, VMemConfigError, VMemError)
from .pool import PagePool


class VirtualRange:
    """``size_bytes`` (rounded up to whole pages) of reserved address space on ``pool``'s driver."""

    def __init__(self, pool: PagePool, size_bytes: int) -> None:
        if not isinstance(pool, PagePool):    # a driver or its name failed on pool.page_bytes
            raise VMemConfigError(f"a virtual range needs pool, a PagePool (its pages are mapped "
                                  f"there), got {type(pool).__name__} {repr(pool)[:60]}")
        self.num_pages = _page_count(size_bytes, pool.page_bytes)
        pool._check_usable()
        self.pool = pool
        self.driver = pool.driver
        self.page_bytes = pool.page_bytes
        self.size_bytes = self.num_pages * self.page_bytes
        self._lock = pool._lock            # one lock: the pool's state and its ranges'
        self._mapped: dict[int, int] = {}  # page index -> pool page id
        self._closed = self._forked = False
        self._views = 0                    # live tensor storages over this range
        self._held: dict[int, int] = {}    # retired: page index -> pool page its views show
        self._copied_pages = 0             # retired: pages copied for its views (host)
        with self._lock:
            self.address = self.driver.reserve(self.size_bytes)
            pool._ranges.add(self)
        forks.track_range(self)

    # -- mapping --
    def map(self, page_index: int, page_id: int) -> None:
        """Map pool page ``page_id`` at ``page_index``. A map the driver refuses leaves a
        discarded page discarded; a grow pool's chunk made for it stays (docs/errors.md)."""
        with self._lock:
            page_index = self._check_index(page_index, use=True)
            if page_index in self._mapped:
                raise AlreadyMappedError(f"page index {page_index} already has pool page "
                                         f"{self._mapped[page_index]} mapped; unmap it first")
            page_id = self.pool._check_id(page_id)
            was_discarded = self.pool.is_discarded(page_id)
            handle = self.pool._handle_for_mapping(page_id)    # re-creates a discarded page
            try:
                self.driver.map(self._page_address(page_index), handle, self.page_bytes)
            except VMemError:     # its memory back, committed bytes as they were (a discard
                if was_discarded:  # failing too leaves it committed: committed_pages says so)
                    with suppress(VMemError):
                        self.pool.discard(page_id)
                raise
            self._mapped[page_index] = page_id     # one write: the pool counts from it

    def unmap(self, page_index: int) -> int:
        """Unmap ``page_index``; returns the pool page that was there (still allocated)."""
        with self._lock:
            page_index = self._check_index(page_index, use=True)
            if page_index not in self._mapped:
                raise NotMappedError(f"page index {page_index} has nothing mapped")
            page_id = self._mapped.pop(page_index)   # first: never recorded yet unmapped
            try:
                self.driver.unmap(self._page_address(page_index), self.page_bytes)
            except BaseException:
                self._mapped[page_index] = page_id
                raise
            return page_id

    # -- undoing a map or an unmap that may have stopped anywhere (an interrupt) --
    def undo_map(self, page_index: int) -> None:
        """After ``map(page_index, ...)`` however far it got: nothing mapped there (a mapping
        the driver made but the range had not yet recorded is unmapped too)."""
        with self._lock:
            page_index = self._check_index(page_index)
            if self._forked:      # a forked child's map was refused before it did anything
                return
            if page_index in self._mapped:
                self.unmap(page_index)
            else:      # the driver may have mapped it before the interrupt: ask it
                self.driver.unmap_if_mapped(self._page_address(page_index), self.page_bytes)

    def undo_unmap(self, page_index: int, page_id: int) -> None:
        """After ``unmap(page_index)`` of ``page_id`` however far it got: mapped again."""
        with self._lock:
            page_index = self._check_index(page_index)
            if self._forked:      # as was its unmap
                return
            mapped_now = self._mapped.get(page_index)
            if mapped_now == page_id:
                return
            if mapped_now is not None:     # refused before any driver call: nothing changes
                raise AlreadyMappedError(f"cannot undo the unmap of pool page {page_id} at page "
                                         f"index {page_index}: pool page {mapped_now} is mapped "
                                         f"there now; unmap it first")
            self.driver.unmap_if_mapped(self._page_address(page_index), self.page_bytes)
            self.map(page_index, page_id)

    def page_at(self, page_index: int) -> int | None:
        """The pool page mapped at ``page_index``, or None."""
        with self._lock:
            return self._mapped.get(self._check_index(page_index))

    def is_mapped(self, page_index: int) -> bool:
        return self.page_at(page_index) is not None

    def mapped_pages(self) -> dict[int, int]:
        """page index -> pool page id, for every mapped index (a copy)."""
        with self._lock:
            self._check_open()
            return dict(self._mapped)

    @property
    def num_mapped_pages(self) -> int:
        return len(self._mapped)

    @property
    def live_views(self) -> int:
        """Tensor storages made by ``tensor`` that are still alive (views of one count once)."""
        with self._lock:      # counts the views that died while another thread held it
            return self._views

    def _page_address(self, page_index: int) -> int:
        return self.address + page_index * self.page_bytes

    # -- views --
    def tensor(self, offset_bytes: int = 0, num_bytes: int | None = None, dtype=None, shape=None):
        """A zero-copy torch tensor over bytes [offset_bytes, offset_bytes + num_bytes).

        ``offset_bytes`` and ``num_bytes`` must be multiples of the dtype's element size and lie
        inside the range. Reading bytes that are not mapped faults (host: SIGSEGV), so map
        before you touch. ``dtype``: a ``torch.dtype`` (default uint8); ``shape`` (default 1-D)
        must hold exactly ``num_bytes`` of it, else VMemConfigError naming it. The view keeps
        what is mapped under it readable after ``close()`` (see the module docstring).
        """
        import torch
        dtype = torch.uint8 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise VMemConfigError(f"tensor takes dtype, a torch.dtype (torch.float16, ...), got "
                                  f"{type(dtype).__name__} {dtype!r}")
        with self._lock:
            self._check_open()
            self._check_not_forked()
            offset_bytes = as_int(offset_bytes, "offset_bytes")
            num_bytes = self.size_bytes - offset_bytes if num_bytes is None else \
                as_int(num_bytes, "num_bytes")
            element_bytes = torch.empty(0, dtype=dtype).element_size()
            self._check_view(offset_bytes, num_bytes, dtype, element_bytes)
            _check_shape(shape, num_bytes // element_bytes, dtype)
            counted = num_bytes > 0
            self._views += counted
        try:
            raw = self.driver.tensor(self.address + offset_bytes, num_bytes,
                                     on_release=self._view_released if counted else None)
        except BaseException:
            if counted:
                self._view_released()
            raise
        view = raw.view(dtype)
        return view if shape is None else view.view(shape)

    def _check_view(self, offset_bytes: int, num_bytes: int, dtype, element_bytes: int) -> None:
        if offset_bytes < 0 or num_bytes < 0 or offset_bytes + num_bytes > self.size_bytes:
            raise PageIndexError(f"bytes [{offset_bytes}, {offset_bytes + num_bytes}) lie outside "
                                 f"the range of {self.size_bytes} bytes")
        if offset_bytes % element_bytes or num_bytes % element_bytes:
            raise AlignmentError(f"offset {offset_bytes} and length {num_bytes} bytes must be "
                                 f"multiples of the {dtype} element size {element_bytes}")

    def _view_released(self) -> None:
        """The release of a view's storage (its finalizer): any thread, never raises, never waits for
        the pool's lock (module docstring: counted now, or as the lock holder's call returns)."""
        self._lock.submit(self._one_view_fewer)

    def _one_view_fewer(self) -> None:
        """Under the pool's lock: one view fewer; the last one of a closed range frees it."""
        self._views -= 1
        if not self._views and self._closed:
            self._free_retired()

    def copy_page(self, dst_page_index: int, src_page_index: int) -> None:
        """Copy the bytes of one mapped page to another mapped page of this range."""
        with self._lock:
            self._check_not_forked()
            for index in (dst_page_index, src_page_index):
                if not self.is_mapped(index):
                    raise NotMappedError(f"page index {index} has nothing mapped; cannot copy")
            self.driver.copy(self._page_address(dst_page_index),
                             self._page_address(src_page_index), self.page_bytes)

    # -- lifecycle --
    def close(self) -> None:
        """Unmap every page (pages stay allocated in the pool) and free the reservation; with
        views alive, retire instead (module docstring). In a forked child it frees only the
        child's copy."""
        with self._lock:
            if self._closed:
                return
            if self._views or self._forked:
                self._retire(detach=not self._forked)
            else:
                for page_index in sorted(self._mapped):
                    self.unmap(page_index)
                self.driver.free_reservation(self.address, self.size_bytes)
            self._closed = True
            self.pool._ranges.discard(self)
            if self._held:                    # until its last view dies (_free_retired)
                self.pool._holders.add(self)

    def __del__(self) -> None:
        """Dropped without ``close()``: unmap and free the reservation (no view can be alive:
        each holds this range; the pool may have gone first, in the same garbage). Never
        raises; a forked child's copy is left to the child's exit."""
        try:
            if self._closed or self._forked:
                return
            self._closed = True
            for page_index in self._mapped:
                self.driver.unmap(self._page_address(page_index), self.page_bytes)
            self._mapped.clear()
            self.driver.free_reservation(self.address, self.size_bytes)
        except BaseException:       # interpreter shutdown, a failing driver: nothing to report to
            pass

    def _retire(self, detach: bool) -> None:
        """Keep the addresses readable until the last view dies: copy each mapped page when
        the copies fit (one ``Driver.commit`` of them all), else hold it (module docstring). A
        forked child's pages were detached at the fork: they go back, nothing to hold."""
        pages = sorted(self._mapped.items())
        if detach and pages:
            try:
                self._copied_pages = self.driver.commit(
                    len(pages), self.page_bytes, lambda: self._copy_pages(pages), "copying")
            except InsufficientMemoryError:
                pass                          # nothing copied: every page is held
            else:                             # not copied (CUDA, a failed copy): not committed
                self.driver.recent_commits.released(len(self._mapped) * self.page_bytes)
            self._held = dict(self._mapped)
        self._mapped.clear()                  # the pool counts no mapping of them any more
        if not self._views:
            self._free_retired()

    def _copy_pages(self, pages: List[tuple]) -> int:
        """Detach each of ``pages`` (index, pool page) with a copy; returns how many were.
        Two failures in a row hold the rest untried: out of mappings, each next one was refused
        after a count of them all (minutes for a large range), and CUDA can detach none."""
        failures = 0
        for page_index, page_id in pages:
            if self._detach(page_index, page_id, copy=True):
                del self._mapped[page_index]  # its own memory now: nothing of the pool's
                failures = 0
            elif (failures := failures + 1) == 2:
                break
        return len(pages) - len(self._mapped)

    def _detach(self, page_index: int, page_id: int, copy: bool) -> bool:
        try:
            return self.driver.detach(self._page_address(page_index),
                                      self.pool._handle_of(page_id), self.page_bytes, copy)
        except VMemError:   # out of mappings, say: the page stays as it is (held)
            return False

    def _free_retired(self) -> None:
        """Unmap the held pages, free the reservation, give the held pages back to the pool
        and the copies' bytes to ``RecentCommits``. Under the pool's lock; never raises: it runs
        from a tensor's deleter (a forked CUDA child can call nothing and frees nothing)."""
        for page_index in self._held:
            try:
                self.driver.unmap(self._page_address(page_index), self.page_bytes)
            except VMemError:
                pass
        try:
            self.driver.free_reservation(self.address, self.size_bytes)
            self.driver.recent_commits.released(self._copied_pages * self.page_bytes)
        except VMemError:
            pass
        pool = self.pool        # held pages released meanwhile, held nowhere else: free now
        pages, self._held = set(self._held.values()), {}
        pool._holders.discard(self)
        for page_id in pages - set(pool._mapping_counts(held=True)):
            if pool._closed:    # destroyed at its close(): the memory is gone only now
                self.driver.recent_commits.released(self.page_bytes)
            elif pool._is_free[page_id]:     # released meanwhile (parked)
                pool._free.append(page_id)

    def _after_fork_in_child(self) -> None:
        """vmem/forks.py: detach every mapped page from the parent's; refuse page uses. Once:
        a fork from a forked child finds the pages detached, their memfds closed (the fd
        numbers may name other files by then)."""
        if self._forked:
            return
        self._forked = True
        copy = self.pool.closed     # its page files are gone: only a copy cuts a held page off
        for page_index, page_id in {**self._mapped, **self._held}.items():
            self._detach(page_index, page_id, copy=copy)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("virtual range used after close()")

    def _check_not_forked(self) -> None:
        if self._forked:
            raise forks.forked_error("virtual range")

    def _check_index(self, page_index: int, use: bool = False) -> int:
        """``page_index`` as an int (numpy integers too) in the range, else PageIndexError."""
        self._check_open()
        if use:
            self._check_not_forked()
        return check_index(page_index, self.num_pages, "page index", "the range's",
                           PageIndexError)

    def __enter__(self) -> "VirtualRange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"VirtualRange(address={self.address:#x}, size_bytes={self.size_bytes}, "
                f"page_bytes={self.page_bytes}, mapped={len(self._mapped)}/{self.num_pages})")


def _check_shape(shape, num_elements: int, dtype) -> None:
    """VMemConfigError naming ``shape`` unless it is None or views ``num_elements`` of
    ``dtype`` (torch's own rule, one -1 included, on a meta tensor: no memory)."""
    if shape is None:
        return
    import torch
    try:
        torch.empty(num_elements, dtype=dtype, device="meta").view(shape)
    except (TypeError, RuntimeError) as error:
        raise VMemConfigError(f"tensor shape {shape!r} does not hold the view's {num_elements} "
                              f"{dtype} elements exactly ({error}); give a shape whose sizes "
                              f"multiply to {num_elements}") from None


def _page_count(size_bytes, page_bytes: int) -> int:
    """Whole pages of ``page_bytes`` covering ``size_bytes``; VMemConfigError naming it unless
    it is an int >= 1 whose pages span at most ``MAX_BYTES`` (vmem/checks.py)."""
    try:
        size = as_int(size_bytes, "size_bytes")
    except VMemConfigError:
        size = 0
    pages = -(-size // page_bytes)
    if size < 1 or pages * page_bytes > MAX_BYTES:
        raise VMemConfigError(f"a virtual range needs size_bytes >= 1 and, in whole pages of "
                              f"{page_bytes} bytes, at most {MAX_BYTES} (128 TiB, the address "
                              f"space vmem allows), got {size_bytes!r}")
    return pages
