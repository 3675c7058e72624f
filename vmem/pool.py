"""PagePool: physical pages named by ids 0..total_pages-1, created up front or on demand,
given back to the device and re-created page by page.

Eager (the default): every page is created with the pool (one ``create_pages`` call), so
mapping never pays for creation. ``grow=True``: a page is created when first mapped, in chunks
(a quarter of what was created, at least 16 pages; the page alone when a chunk does not fit).
``extend`` adds ids at the end, created the same way. ``discard`` gives pages' memory back (ids
stay allocated or free, bytes are lost); mapping one again, or ``recommit``, re-creates exactly
that page; ``committed_pages=k`` starts ids k.. discarded. Every creation is checked against
the device's available memory first (``InsufficientMemoryError``, nothing created). A page's
mappings are counted from its open ranges' records (one truth: no interrupt can part a count
from a record); a page mapped somewhere cannot be released or discarded. One *held* by a closed
range's view (vmem/vrange.py) is never mapped, discarded or freed (``release`` parks it) until
the view dies. Threads: a pool and its ranges share one lock held across every call, counters
included (its cost, map + unmap with and without it, is a ratio ``benchmarks/alloc.py`` prints:
1.02x for 4 KiB host pages); a view dying while another thread holds it is counted as that
thread's call returns (``commits.DrainingLock``), so no call sees pages of a dead view still
held. Fork: see vmem/forks.py.
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Iterable, Optional, Union

from . import commits, forks
from .checks import check_count, check_flag, check_index, id_list
from .driver import Driver, check_driver
from .errors import ClosedError, InsufficientMemoryError, PageStateError, PoolExhaustedError
from .host import RECORD_BYTES, check_pool_records

MIN_GROWTH_PAGES = 16
Slot = tuple[int, int]       # (batch, index): where a created page's handle lives


class PagePool:
    """``total_pages`` physical pages of ``page_bytes`` each on ``driver``.

    Invariants (``check_integrity``): free + allocated == total; a free page has no mappings;
    every id is committed (its memory exists), discarded (mapped nowhere) or never created;
    each created page is bound to one id or in stock, never both. A held page released
    (flagged free) is *parked*: off the free list until its view dies.
    """

    def __init__(self, driver: Driver, num_pages: int, page_bytes: int, grow: bool = False,
                 committed_pages: Optional[int] = None) -> None:
        num_pages = check_count(num_pages, "a page pool needs num_pages", least=1)
        kept = num_pages if committed_pages is None else committed_pages
        kept = check_count(kept, "committed_pages must be None or", most=num_pages)
        page_bytes = check_driver(driver).check_bytes(page_bytes)   # "host" is no driver
        check_pool_records(num_pages)     # before any list of num_pages is built
        self.driver, self.page_bytes, self.grow = driver, page_bytes, check_flag(grow, "grow")
        self._batches: list[list[Any]] = []     # one per create_pages call (release unit)
        self._created = 0                        # pages in _batches (discarded ones included)
        self._stock: list[Slot] = []             # created, not yet bound to an id
        self._slot: list[Optional[Slot]] = [None] * num_pages    # id -> its page (None: none)
        self._discarded: set[int] = set()        # ids whose memory was given back
        try:                                     # checked and created before any other list
            if kept and not grow:       # the records (built next) checked with the pages
                self._create(kept, records_bytes=num_pages * RECORD_BYTES)
                self._bind(range(kept))
            if kept < num_pages:                 # the rest start discarded: no memory yet
                self._create(num_pages - kept, discarded=True)
                self._bind(range(kept, num_pages))
                self._discarded.update(range(kept, num_pages))
        except BaseException:
            for batch in self._batches:          # a failed build leaves no page behind
                driver.release_pages(batch)
            raise
        # LIFO free list: the most recently released page is reused first (warm in caches/TLB).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages
        self._closed = self._forked = False
        self._lock = commits.DrainingLock()             # this pool's and its ranges' state
        self._ranges: "weakref.WeakSet" = weakref.WeakSet()   # open ranges mapping from it
        self._holders: set = set()      # closed ranges whose views hold pages (vmem/vrange.py)
        forks.track_pool(self)

    def _create(self, num_pages: int, discarded: bool = False, records_bytes: int = 0) -> None:
        """Create ``num_pages`` pages into the stock (memory checked first, unless discarded)."""
        if discarded:
            batch = list(self.driver.create_pages(num_pages, self.page_bytes, discarded=True))
        else:
            batch = list(self.driver.commit(num_pages, self.page_bytes, lambda: self.driver
                         .create_pages(num_pages, self.page_bytes), records_bytes=records_bytes))
        self._batches.append(batch)
        self._created += len(batch)
        self._stock.extend((len(self._batches) - 1, i) for i in reversed(range(len(batch))))

    def _bind(self, page_ids: Iterable[int]) -> None:
        for page_id in page_ids:
            self._slot[page_id] = self._stock.pop()

    def _recreate(self, page_ids: list[int]) -> None:
        """Memory again for discarded ``page_ids`` (all or none, one driver call)."""
        old = [self._handle_of(page_id) for page_id in page_ids]
        handles = list(self.driver.commit(len(old), self.page_bytes, lambda: self.driver
                                          .recreate_pages(old, self.page_bytes), "re-creating"))
        assert len(handles) == len(page_ids), "recreate_pages returned a handle per page"
        for page_id, handle in zip(page_ids, handles):
            batch, index = self._slot[page_id]
            self._batches[batch][index] = handle
            self._discarded.discard(page_id)

    # -- counters --
    @property
    def total_pages(self) -> int:
        return len(self._slot)

    @property
    def committed_pages(self) -> int:
        """Pages whose physical memory exists now (created, not discarded; stock included)."""
        with self._lock:
            return self._created - len(self._discarded)

    @property
    def committed_bytes(self) -> int:
        return self.committed_pages * self.page_bytes

    @property
    def discarded_pages(self) -> int:
        """Ids whose memory ``discard`` gave back and nothing has re-created yet."""
        with self._lock:
            return len(self._discarded)

    @property
    def free_pages(self) -> int:
        with self._lock:      # counts the views that died while another thread held it
            return len(self._free)

    @property
    def allocated_pages(self) -> int:
        return self.total_pages - self.free_pages

    @property
    def mapped_pages(self) -> int:
        """Pages mapped at one address or more."""
        with self._lock:
            return len(self._mapping_counts())

    @property
    def held_pages(self) -> int:     # shown by a closed range's view (vmem/vrange.py)
        with self._lock:
            return len(self._mapping_counts(held=True))

    def mapping_count(self, page_id: int) -> int:
        with self._lock:
            return self._mapping_counts()[self._check_id(page_id)]

    def is_free(self, page_id: int) -> bool:
        with self._lock:
            return self._is_free[self._check_id(page_id)]

    def is_discarded(self, page_id: int) -> bool:
        with self._lock:
            return self._check_id(page_id) in self._discarded

    def has_memory(self, page_id: int) -> bool:
        """Whether ``page_id``'s physical memory exists now (created, not discarded)."""
        with self._lock:
            page_id = self._check_id(page_id)
            return self._slot[page_id] is not None and page_id not in self._discarded

    # -- allocation --
    def allocate(self, num_pages: int = 1) -> list[int]:
        """Take ``num_pages`` free pages (all or none)."""
        with self._lock:
            self._check_usable()
            num_pages = check_count(num_pages, "allocate takes a page count")
            if num_pages > len(self._free):
                raise PoolExhaustedError(f"page pool exhausted: asked for {num_pages} pages, "
                                         f"{len(self._free)} of {self.total_pages} free")
            taken = [self._free.pop() for _ in range(num_pages)]
            for page_id in taken:
                self._is_free[page_id] = False
            return taken

    def release(self, pages: Union[int, Iterable[int]]) -> None:
        """Return one page id, or every id of a list (what ``allocate`` returns), to the free
        list; each allocated and mapped nowhere (one a closed range's view holds is *parked*:
        flagged free, listed free as the view dies). All or none. A forked child may too."""
        with self._lock:
            self._check_open()
            ids = self._ids(pages)
            counts, held = self._mapping_counts(), self._mapping_counts(held=True)
            for page_id in ids:
                if self.is_free(page_id):
                    raise PageStateError(f"page {page_id} is already free (released twice?)")
                _check_unmapped(page_id, counts)
            for page_id in ids:
                self._is_free[page_id] = True
                if not held[page_id]:     # else parked: listed free as its view dies
                    self._free.append(page_id)

    # -- elastic memory --
    def discard(self, pages: Union[int, Iterable[int]]) -> None:
        """Give back the physical memory of one page id or a list of them; each stays allocated
        or free as it was, and its bytes are lost. All or none: each must be committed and
        mapped nowhere (else PageStateError, nothing changed). One driver call per page, so a
        DriverCallError part way leaves exactly the pages before the failing one discarded."""
        with self._lock:
            self._check_usable()
            ids = self._ids(pages)
            counts = self._mapping_counts()
            for page_id in ids:
                self._check_discardable(page_id, counts)
            for page_id in ids:
                self.driver.discard_pages([self._handle_of(page_id)], self.page_bytes)
                self._discarded.add(page_id)
                self.driver.recent_commits.released(self.page_bytes)

    def _check_discardable(self, page_id: int, counts: Counter) -> None:
        if self._slot[page_id] is None:
            raise PageStateError(f"page {page_id} was never created (an on-demand pool creates "
                                 f"it on first mapping); there is no memory to discard")
        if page_id in self._discarded:
            raise PageStateError(f"page {page_id} is already discarded (discarded twice?)")
        _check_unmapped(page_id, counts)
        self._check_not_held(page_id)

    def _check_not_held(self, page_id: int) -> None:    # its view shows exactly its bytes
        if self._holders and self._mapping_counts(held=True)[page_id]:
            raise PageStateError(f"page {page_id} is held by a tensor view of a closed range "
                                 f"(no memory to copy it at close()); drop the view first")

    def recommit(self, pages: Union[int, Iterable[int]]) -> None:
        """Re-create the memory of discarded page ids, all or none (one driver call): each must
        be discarded (else PageStateError), all must fit in the available memory (else
        InsufficientMemoryError). Their bytes are unspecified (host: zeros)."""
        with self._lock:
            self._check_usable()
            ids = self._ids(pages)
            for page_id in ids:
                if page_id not in self._discarded:
                    raise PageStateError(f"page {page_id} is not discarded; only discarded "
                                         f"pages can be recommitted")
            if ids:
                self._recreate(ids)

    def extend(self, num_pages: int) -> list[int]:
        """Add ``num_pages`` ids at the end (``total_pages`` grows by as many) and return them,
        free for the caller to allocate. An eager pool creates their pages now, after checking
        available memory (InsufficientMemoryError, nothing added); ``grow`` on first mapping."""
        with self._lock:
            self._check_usable()
            num_pages = check_count(num_pages, "extend takes a page count")
            check_pool_records(num_pages)     # before any list of num_pages is built
            new = list(range(self.total_pages, self.total_pages + num_pages))
            if new and not self.grow:
                self._create(num_pages, records_bytes=num_pages * RECORD_BYTES)
            self._slot.extend([None] * num_pages)
            self._is_free.extend([True] * num_pages)
            if not self.grow:
                self._bind(new)
            self._free[:0] = reversed(new)      # under the warm pages: reused after them
            return new

    # -- used by VirtualRange, under self._lock --
    def _handle_for_mapping(self, page_id: int) -> Any:
        self._check_usable()
        page_id = self._check_id(page_id)
        if self._is_free[page_id]:
            raise PageStateError(f"page {page_id} is free; allocate it from the pool before "
                                 f"mapping")
        self._check_not_held(page_id)
        if self._slot[page_id] is None:     # on demand: create (a chunk) on first mapping
            if not self._stock:
                left = self.total_pages - self._created
                chunk = min(left, max(MIN_GROWTH_PAGES, self._created // 4))
                try:
                    self._create(chunk)
                except InsufficientMemoryError:
                    if chunk == 1:
                        raise
                    self._create(1)       # the chunk does not fit: this page alone
            self._bind([page_id])
        elif page_id in self._discarded:    # exactly this page, not a chunk
            self._recreate([page_id])
        return self._handle_of(page_id)

    def _mapping_counts(self, held: bool = False) -> Counter:
        """page id -> the addresses mapping it, from the open ranges' records (one truth: no
        interrupt can part a count from a record); ``held``: the pages closed ranges hold."""
        counts: Counter = Counter()
        for vrange in list(self._holders if held else self._ranges):
            counts.update((vrange._held if held else vrange._mapped).values())
        return counts

    def _handle_of(self, page_id: int) -> Any:
        batch, index = self._slot[page_id]
        return self._batches[batch][index]

    # -- lifecycle --
    def check_integrity(self) -> None:
        """Assert every invariant above, each recomputed from scratch (the mapping counts from
        what the open ranges map)."""
        with self._lock:
            assert len(self._free) == len(set(self._free)), "duplicate page on the free list"
            counts, held = self._mapping_counts(), self._mapping_counts(held=True)
            parked = sum(self._is_free[page_id] for page_id in held)
            assert sum(self._is_free) == len(self._free) + parked, "free flags, free list"
            for page_id in self._free:
                assert counts[page_id] == held[page_id] == 0, f"free page {page_id} is mapped"
            never = {i for i, slot in enumerate(self._slot) if slot is None}
            slots = [slot for slot in self._slot if slot is not None] + self._stock
            assert len(set(slots)) == len(slots) == self._created \
                == sum(map(len, self._batches)), "a created page is bound twice, or lost"
            assert not self._discarded & never and len(self._stock) <= len(never), "stock"
            assert self.committed_pages - len(self._stock) + self.discarded_pages + len(never) \
                == self.total_pages, "ids: committed + discarded + never created != total"
            for page_id in self._discarded | never:
                assert counts[page_id] == 0, f"page {page_id} is mapped, no memory"

    def close(self) -> None:
        """Destroy every page (a held one's memory goes when its view dies); refused while
        any is mapped (close ranges first). A forked child only forgets them (its copies went)."""
        with self._lock:
            if self._closed:
                return
            if self._mapping_counts():
                raise PageStateError(f"cannot close the pool: {self.mapped_pages} page(s) are "
                                     f"still mapped; close the ranges that map them first")
            if not self._forked:
                self._release_batches()
            self._closed = True

    def _release_batches(self) -> None:
        dead = {self._slot[page_id] for page_id in self._discarded}
        held = len(self._mapping_counts(held=True))   # given back as their views die
        for b, batch in enumerate(self._batches):    # never a discarded handle as live
            live = [h for i, h in enumerate(batch) if (b, i) not in dead]
            gone = [h for i, h in enumerate(batch) if (b, i) in dead]
            self.driver.release_pages(live, discarded=gone)
            released, held = max(0, len(live) - held), max(0, held - len(live))
            self.driver.recent_commits.released(released * self.page_bytes)

    def __del__(self) -> None:
        """Dropped without ``close()``: destroy every page (a range in the same garbage unmaps
        its own; memfd and cuMemRelease free memory at its last unmap). Never raises."""
        try:
            if not (self._closed or self._forked):
                self._closed = True
                self._release_batches()
        except BaseException:       # interpreter shutdown, a failing driver: nothing to report to
            pass

    def _after_fork_in_child(self) -> None:
        """vmem/forks.py: drop the child's copies of the page files; refuse page uses. Once:
        in a fork from a forked child the fd numbers may name the child's other files now."""
        if self._forked:
            return
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

    def _check_usable(self) -> None:     # what touches pages: open, not a forked child's copy
        self._check_open()
        if self._forked:
            raise forks.forked_error("page pool")

    def _check_id(self, page_id: int) -> int:
        """``page_id`` as an int (numpy integers too) in the pool, else PageStateError."""
        return check_index(page_id, len(self._slot), "page id", "the pool's", PageStateError)

    def _ids(self, pages: Union[int, Iterable[int]]) -> list[int]:
        """One id or an iterable of them, as checked ints; PageStateError naming one twice."""
        ids = [self._check_id(page_id) for page_id in id_list(pages)]
        if len(set(ids)) != len(ids):
            raise PageStateError(f"page ids {ids[:8]} name a page twice")
        return ids

    def __enter__(self) -> "PagePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PagePool(page_bytes={self.page_bytes}, total={self.total_pages}, "
                f"committed={self.committed_pages}, discarded={self.discarded_pages}, "
                f"free={self.free_pages}, mapped={self.mapped_pages})")


def _check_unmapped(page_id: int, counts: Counter) -> None:
    if counts[page_id]:
        raise PageStateError(f"page {page_id} is still mapped at {counts[page_id]} address(es); "
                             f"unmap it first")

