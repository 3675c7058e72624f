"""PageLedger: the one record of a pool's physical pages (vmem pages, or paged blocks) -- which
are free and which tenant holds each -- journaled like every manager container.

    ledger = PageLedger(cell, num_pages=8)
    pages = ledger.take(3, tenant="full")      # (0, 1, 2) from a fresh ledger
    ledger.give(pages[1:])                     # back to the free list
    ledger.free_pages, ledger.held("full")     # 6, 1

The manager that owns a ledger decides which page backs what; executors are told the page
ids in the ops and never choose (every tensor-parallel rank applies the same ones). A tenant
is any hashable name (a layer kind's table, a paged block group, a LoRA adapter's weights:
``("adapter", digest)``, adapters.py); ``RELEASED`` is the device
itself: pages given back to it (an elastic pool shrunk, an engine asleep) whose memory the
executor discards, taken back by ``restore``. The ledger counts what each tenant holds so an
integrity check can account every page exactly once. Inside a
transaction (the manager's ``TxnCell`` holds a journal) every change logs its inverse first,
so ``rollback`` puts back the free list in order, each page's holder and the counts.
"""
from __future__ import annotations

from collections import Counter
from itertools import compress, repeat
from operator import is_
from typing import Hashable, Iterable, Optional

from ..errors import ConfigError, OutOfCapacityError
from .journal import MISSING, JDict, JList, TxnCell, cut_to, put_back, put_last


RELEASED = "released"     # the tenant of pages given back to the device (no memory behind them)


class PageLedger:
    """``num_pages`` physical pages: a free stack (a fresh ledger hands out 0, 1, 2, ...),
    each taken page's tenant, and the pages each tenant holds. O(1) a page to take or give.
    ``in_service_pages``: pages 0.. of them start free, the rest ``RELEASED`` (default all)."""

    __slots__ = ("num_pages", "_cell", "_free", "_holder", "_held", "_released")

    def __init__(self, cell: TxnCell, num_pages: int,
                 in_service_pages: Optional[int] = None) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"a page ledger needs num_pages >= 1, got {num_pages!r}")
        serve = num_pages if in_service_pages is None else in_service_pages
        if isinstance(serve, bool) or not isinstance(serve, int) or not 0 <= serve <= num_pages:
            raise ConfigError(f"in_service_pages must be in 0..{num_pages}, got {serve!r}")
        self.num_pages = num_pages
        self._cell = cell
        self._free = JList(cell, range(serve - 1, -1, -1))       # pop() -> lowest free page
        self._holder = JList(cell, [None] * serve + [RELEASED] * (num_pages - serve))
        self._held = JDict(cell)                                  # tenant -> pages held
        if serve < num_pages:
            self._held[RELEASED] = num_pages - serve
        self._released = JList(cell, range(num_pages - 1, serve - 1, -1))  # restore() order

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def held(self, tenant: Hashable) -> int:
        """Pages ``tenant`` holds."""
        return self._held.get(tenant, 0)

    def holder(self, page: int) -> Optional[Hashable]:
        """The tenant holding ``page`` (None: free)."""
        return self._holder[page]

    def tenants(self) -> dict:
        """{tenant: pages held} for every tenant holding any."""
        return dict(self._held)

    def take(self, count: int, tenant: Hashable) -> tuple:
        """``count`` free pages for ``tenant``; OutOfCapacityError (nothing changed) when
        fewer are free."""
        if tenant is None:
            raise ConfigError("a page ledger tenant cannot be None (None marks a free page)")
        if count > len(self._free):
            raise OutOfCapacityError(f"{tenant!r} needs {count} pages, {len(self._free)} of "
                                     f"{self.num_pages} free")
        return tuple(self.take_one(tenant) for _ in range(count))

    def take_one(self, tenant: Hashable) -> int:
        """``take(1, tenant)[0]``: the managers' per-block hot path, one journal entry (an
        absolute undo, right whether the change was made or not) instead of one per write."""
        if tenant is None:
            raise ConfigError("a page ledger tenant cannot be None (None marks a free page)")
        free, held = self._free, self._held
        if not free:
            raise OutOfCapacityError(f"{tenant!r} needs 1 page, 0 of {self.num_pages} free")
        page, count = free[-1], dict.get(held, tenant, 0)
        cell = self._cell
        if cell.active:
            cell.log(self._untake, len(free), page, tenant, count)
        list.pop(free)
        list.__setitem__(self._holder, page, tenant)
        dict.__setitem__(held, tenant, count + 1)
        return page

    def _untake(self, length: int, page: int, tenant: Hashable, count: int) -> None:
        put_last(self._free, length, page)
        list.__setitem__(self._holder, page, None)
        put_back(self._held, tenant, count if count else MISSING)

    def give_one(self, page: int) -> None:
        """``give((page,))``: the managers' per-block hot path, one journal entry."""
        holder, held = self._holder, self._held
        tenant = holder[page]
        if tenant is None:
            raise AssertionError(f"page {page} is free already")   # a bug
        count = dict.__getitem__(held, tenant)
        cell = self._cell
        if cell.active:
            cell.log(self._ungive, len(self._free), page, tenant, count)
        if count > 1:
            dict.__setitem__(held, tenant, count - 1)
        else:
            dict.__delitem__(held, tenant)
        list.__setitem__(holder, page, None)
        list.append(self._free, page)

    def _ungive(self, length: int, page: int, tenant: Hashable, count: int) -> None:
        cut_to(self._free, length)
        list.__setitem__(self._holder, page, tenant)
        dict.__setitem__(self._held, tenant, count)

    @property
    def released_pages(self) -> int:
        """Pages given back to the device."""
        return len(self._released)

    @property
    def in_service_pages(self) -> int:
        """Pages the pool may use: free or held by a tenant other than the device."""
        return self.num_pages - len(self._released)

    def release(self, count: int) -> tuple:
        """``count`` free pages given back to the device (``RELEASED``); OutOfCapacityError
        (nothing changed) when fewer are free."""
        pages = self.take(count, RELEASED)
        for page in pages:
            self._released.append(page)
        return pages

    def restore(self, count: int) -> tuple:
        """``count`` released pages back into service, free (the last released first);
        OutOfCapacityError (nothing changed) when fewer were released."""
        if count > len(self._released):
            raise OutOfCapacityError(f"restoring {count} pages: only {len(self._released)} of "
                                     f"{self.num_pages} are released")
        pages = tuple(self._released.pop() for _ in range(count))
        self.give(pages)
        return pages

    def give(self, pages: Iterable[int]) -> None:
        """Pages back to the free list (each must be held). The list is a stack: the pages
        given back last are taken first, the lowest of them first."""
        pages = sorted(pages, reverse=True)
        if len(set(pages)) != len(pages) or any(self._holder[p] is None for p in pages):
            raise AssertionError(f"pages {pages} include a free page or one twice")  # a bug
        for page in pages:
            self.give_one(page)

    def check_integrity(self) -> None:
        """Every page free or held exactly once; the counts match the holders."""
        free, holders = list(self._free), self._holder   # whole columns: runs every step
        free_set = set(free)
        assert len(free_set) == len(free), "a page is free twice"
        unheld = set(compress(range(len(holders)), map(is_, holders, repeat(None))))
        lost = unheld - free_set
        assert not lost, f"page {min(lost)} is neither free nor held"
        counts = dict(Counter(holders))
        counts.pop(None, None)
        assert len(free) + sum(counts.values()) == self.num_pages, "pages lost or doubled"
        assert counts == dict(self._held), "per-tenant counts"
        released = list(self._released)
        assert len(set(released)) == len(released) == counts.get(RELEASED, 0), "released pages"
        assert all(self._holder[p] == RELEASED for p in released), "a released page is held"

    def journaled_fields(self) -> bool:
        """Every container logs its changes (``journal.journaled``)."""
        return True
