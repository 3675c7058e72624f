"""PagePool: a fixed budget of physical pages, all created up front, handed out by id.

Every page is created when the pool is built (one ``create_pages`` call), so mapping never pays
for page creation and running out is a pool event, never a driver one. Pages are named by ids
0..total_pages-1. The pool counts, per page, how many addresses it is mapped at; ranges update
that count, and a page still mapped somewhere cannot be released.
"""
from __future__ import annotations

from typing import Any

from .driver import Driver
from .errors import ClosedError, PageStateError, PoolExhaustedError, VMemConfigError


class PagePool:
    """``total_pages`` physical pages of ``page_bytes`` each on ``driver``.

    Invariants (``check_integrity``): free + allocated == total; a free page has no mappings.
    """

    def __init__(self, driver: Driver, num_pages: int, page_bytes: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise VMemConfigError(f"a page pool needs num_pages >= 1, got {num_pages!r}")
        driver.check_page_bytes(page_bytes)
        self.driver = driver
        self.page_bytes = page_bytes
        self._handles: list[Any] = list(driver.create_pages(num_pages, page_bytes))
        # LIFO free list: the most recently released page is reused first (warm in caches/TLB).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages
        self._map_counts = [0] * num_pages
        self._closed = False

    # -- counters --
    @property
    def total_pages(self) -> int:
        return len(self._handles)

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
        self._check_open()
        if num_pages > len(self._free):
            raise PoolExhaustedError(f"page pool exhausted: asked for {num_pages} pages, "
                                     f"{len(self._free)} of {self.total_pages} free")
        taken = [self._free.pop() for _ in range(num_pages)]
        for page_id in taken:
            self._is_free[page_id] = False
        return taken

    def release(self, page_id: int) -> None:
        """Return a page to the free list; it must be allocated and mapped nowhere."""
        self._check_open()
        self._check_id(page_id)
        if self._is_free[page_id]:
            raise PageStateError(f"page {page_id} is already free (released twice?)")
        if self._map_counts[page_id]:
            raise PageStateError(f"page {page_id} is still mapped at "
                                 f"{self._map_counts[page_id]} address(es); unmap it first")
        self._is_free[page_id] = True
        self._free.append(page_id)

    # -- used by VirtualRange --
    def _handle_for_mapping(self, page_id: int) -> Any:
        self._check_open()
        self._check_id(page_id)
        if self._is_free[page_id]:
            raise PageStateError(f"page {page_id} is free; allocate it from the pool before mapping")
        return self._handles[page_id]

    def _count_mapping(self, page_id: int, delta: int) -> None:
        self._map_counts[page_id] += delta

    # -- lifecycle --
    def check_integrity(self) -> None:
        assert len(self._free) == len(set(self._free)), "duplicate page on the free list"
        assert sum(self._is_free) == len(self._free), "free flags disagree with the free list"
        for page_id in self._free:
            assert self._map_counts[page_id] == 0, f"free page {page_id} is mapped"
        assert all(count >= 0 for count in self._map_counts), "negative mapping count"

    def close(self) -> None:
        """Destroy every page. Refused while any page is still mapped (close ranges first)."""
        if self._closed:
            return
        if any(self._map_counts):
            raise PageStateError(f"cannot close the pool: {self.mapped_pages} page(s) are still "
                                 f"mapped; close the ranges that map them first")
        self.driver.release_pages(self._handles)
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("page pool used after close()")

    def _check_id(self, page_id: int) -> None:
        if not isinstance(page_id, int) or not 0 <= page_id < len(self._handles):
            raise PageStateError(f"page id {page_id!r} outside the pool's 0..{len(self._handles) - 1}")

    def __enter__(self) -> "PagePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PagePool(page_bytes={self.page_bytes}, total={self.total_pages}, "
                f"free={self.free_pages}, mapped={self.mapped_pages})")
