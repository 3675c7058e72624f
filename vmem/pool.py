"""PagePool: a budget of physical pages, handed out by id, created up front or on demand.

Eager (the default): every page is created when the pool is built (one ``create_pages`` call),
so mapping never pays for page creation and running out is a pool event, never a driver one.
On demand (``grow=True``): ids exist from the start, but a page's physical memory is created
the first time it is mapped, in chunks (a quarter of what exists, at least 16 pages) so driver
calls stay few; what is created stays until ``close``. Either way every creation is first
checked against the device's available memory (``InsufficientMemoryError``, nothing created).

Pages are named by ids 0..total_pages-1. The pool counts, per page, how many addresses it is
mapped at; ranges update that count, and a page still mapped somewhere cannot be released.

Threads: a pool and every range on it share one lock (``threading.RLock``), held across each
allocate, release, map, unmap and integrity check, so any thread may call them (its cost,
map + unmap with the lock against without, is a ratio ``benchmarks/alloc.py`` prints: 1.02x
for 4 KiB host pages). Fork: see vmem/forks.py.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable, Union

from . import forks
from .driver import Driver
from .errors import (ClosedError, InsufficientMemoryError, PageStateError, PoolExhaustedError,
                     VMemConfigError)

MIN_GROWTH_PAGES = 16


class PagePool:
    """``total_pages`` physical pages of ``page_bytes`` each on ``driver``.

    Invariants (``check_integrity``): free + allocated == total; a free page has no mappings;
    each page's mapping count equals the open ranges' mappings of it; committed (created)
    pages <= total.
    """

    def __init__(self, driver: Driver, num_pages: int, page_bytes: int, grow: bool = False) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise VMemConfigError(f"a page pool needs num_pages >= 1, got {num_pages!r}")
        driver.check_page_bytes(page_bytes)
        self.driver = driver
        self.page_bytes = page_bytes
        self.grow = grow
        self._batches: list[list[Any]] = []             # one per create_pages call (release unit)
        self._stock: list[Any] = []                     # created, not yet bound to an id
        if grow:
            self._handles: list[Any] = [None] * num_pages   # page id -> handle (None: not created)
        else:                                           # checked and created before any list
            self._create(num_pages)
            self._handles, self._stock = list(self._batches[0]), []
        # LIFO free list: the most recently released page is reused first (warm in caches/TLB).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages
        self._map_counts = [0] * num_pages
        self._closed = self._forked = False
        self._lock = threading.RLock()                  # this pool's and its ranges' state
        self._ranges: "weakref.WeakSet" = weakref.WeakSet()   # open ranges mapping from it
        forks.track_pool(self)

    def _create(self, num_pages: int) -> None:
        """Create ``num_pages`` pages into the stock, after checking available memory."""
        need = num_pages * self.page_bytes
        available = self.driver.available_bytes()
        if available is not None and need > available:
            raise InsufficientMemoryError(
                f"creating {num_pages} pages of {self.page_bytes} bytes needs {need} bytes "
                f"({need / 2**30:.2f} GiB) but the {self.driver.name} driver reports only "
                f"{available} bytes ({available / 2**30:.2f} GiB) available; ask for fewer pages")
        batch = list(self.driver.create_pages(num_pages, self.page_bytes))
        self._batches.append(batch)
        self._stock.extend(reversed(batch))

    # -- counters --
    @property
    def total_pages(self) -> int:
        return len(self._handles)

    @property
    def committed_pages(self) -> int:
        """Pages whose physical memory exists (all of them unless ``grow``)."""
        return sum(len(batch) for batch in self._batches)

    @property
    def committed_bytes(self) -> int:
        return self.committed_pages * self.page_bytes

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def allocated_pages(self) -> int:
        return self.total_pages - self.free_pages

    @property
    def mapped_pages(self) -> int:
        """Pages mapped at one address or more."""
        return sum(1 for count in self._map_counts if count)

    def mapping_count(self, page_id: int) -> int:
        self._check_id(page_id)
        return self._map_counts[page_id]

    def is_free(self, page_id: int) -> bool:
        self._check_id(page_id)
        return self._is_free[page_id]

    # -- allocation --
    def allocate(self, num_pages: int = 1) -> list[int]:
        """Take ``num_pages`` free pages (all or none)."""
        with self._lock:
            self._check_usable()
            if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
                raise VMemConfigError(f"allocate takes a page count >= 0, got {num_pages!r}")
            if num_pages > len(self._free):
                raise PoolExhaustedError(f"page pool exhausted: asked for {num_pages} pages, "
                                         f"{len(self._free)} of {self.total_pages} free")
            taken = [self._free.pop() for _ in range(num_pages)]
            for page_id in taken:
                self._is_free[page_id] = False
            return taken

    def release(self, pages: Union[int, Iterable[int]]) -> None:
        """Return one page id, or every id of a list (what ``allocate`` returns), to the free
        list; each must be allocated and mapped nowhere. All or none: every id is checked first.
        Bookkeeping only, so a forked child may release too."""
        ids = [pages] if isinstance(pages, int) else list(pages)
        with self._lock:
            self._check_open()
            if len(set(ids)) != len(ids):
                raise PageStateError(f"page ids {ids[:8]} name a page twice")
            for page_id in ids:
                self._check_releasable(page_id)
            for page_id in ids:
                self._is_free[page_id] = True
                self._free.append(page_id)

    def _check_releasable(self, page_id: int) -> None:
        self._check_id(page_id)
        if self._is_free[page_id]:
            raise PageStateError(f"page {page_id} is already free (released twice?)")
        if self._map_counts[page_id]:
            raise PageStateError(f"page {page_id} is still mapped at "
                                 f"{self._map_counts[page_id]} address(es); unmap it first")

    # -- used by VirtualRange, under self._lock --
    def _handle_for_mapping(self, page_id: int) -> Any:
        self._check_usable()
        self._check_id(page_id)
        if self._is_free[page_id]:
            raise PageStateError(f"page {page_id} is free; allocate it from the pool before mapping")
        if self._handles[page_id] is None:     # on demand: create (a chunk) on first mapping
            if not self._stock:
                left = self.total_pages - self.committed_pages
                self._create(min(left, max(MIN_GROWTH_PAGES, self.committed_pages // 4)))
            self._handles[page_id] = self._stock.pop()
        return self._handles[page_id]

    def _count_mapping(self, page_id: int, delta: int) -> None:
        self._map_counts[page_id] += delta

    def _handle_of(self, page_id: int) -> Any:
        return self._handles[page_id]

    # -- lifecycle --
    def check_integrity(self) -> None:
        """Assert every invariant above, each recomputed from scratch (the mapping counts from
        what the open ranges map)."""
        with self._lock:
            assert len(self._free) == len(set(self._free)), "duplicate page on the free list"
            assert sum(self._is_free) == len(self._free), "free flags disagree with the free list"
            for page_id in self._free:
                assert self._map_counts[page_id] == 0, f"free page {page_id} is mapped"
            assert all(count >= 0 for count in self._map_counts), "negative mapping count"
            counted = [0] * len(self._map_counts)
            for vrange in list(self._ranges):
                for page_id in vrange.mapped_pages().values():
                    counted[page_id] += 1
            drifted = [i for i, (a, b) in enumerate(zip(counted, self._map_counts)) if a != b]
            assert not drifted, (f"mapping counts of pages {drifted[:8]} disagree with the "
                                 f"ranges' mappings")
            bound = sum(1 for handle in self._handles if handle is not None)
            assert bound + len(self._stock) == self.committed_pages <= self.total_pages, \
                "created pages disagree with bound + stock"

    def close(self) -> None:
        """Destroy every page. Refused while any page is still mapped (close ranges first).
        In a forked child it only forgets them (the child's copies went at the fork)."""
        with self._lock:
            if self._closed:
                return
            if any(self._map_counts):
                raise PageStateError(f"cannot close the pool: {self.mapped_pages} page(s) are "
                                     f"still mapped; close the ranges that map them first")
            if not self._forked:
                for batch in self._batches:
                    self.driver.release_pages(batch)
            self._closed = True

    def _after_fork_in_child(self) -> None:
        """vmem/forks.py: drop the child's copies of the page files; refuse page uses."""
        self._forked = True
        if not self._closed:
            for batch in self._batches:
                self.driver.close_inherited(batch)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("page pool used after close()")

    def _check_usable(self) -> None:
        """For what touches pages: open, and not a forked child's copy."""
        self._check_open()
        if self._forked:
            raise forks.forked_error("page pool")

    def _check_id(self, page_id: int) -> None:
        if not isinstance(page_id, int) or not 0 <= page_id < len(self._handles):
            raise PageStateError(f"page id {page_id!r} outside the pool's 0..{len(self._handles) - 1}")

    def __enter__(self) -> "PagePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PagePool(page_bytes={self.page_bytes}, total={self.total_pages}, "
                f"committed={self.committed_pages}, free={self.free_pages}, "
                f"mapped={self.mapped_pages})")
