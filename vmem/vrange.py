"""VirtualRange: a reserved, contiguous address range with physical pages mapped on demand.

    address                                            address + size_bytes
    |  page 0  |  page 1  |  page 2  |  ...  | page num_pages-1 |
       mapped    PROT_NONE   mapped               PROT_NONE
       (pool p3) (faults)    (pool p3 again: same bytes as page 0)

Page ``i`` covers bytes [i * page_bytes, (i + 1) * page_bytes). The range remembers which pool
page is mapped at each index; pools count mappings. Tensor views are zero copy and only valid
while the range is open and the pages under them stay mapped.
"""
from __future__ import annotations

from .errors import (AlignmentError, AlreadyMappedError, ClosedError, NotMappedError,
                     PageIndexError, VMemConfigError)
from .pool import PagePool


class VirtualRange:
    """``size_bytes`` (rounded up to whole pages) of reserved address space on ``pool``'s driver."""

    def __init__(self, pool: PagePool, size_bytes: int) -> None:
        if not isinstance(size_bytes, int) or size_bytes < 1:
            raise VMemConfigError(f"a virtual range needs size_bytes >= 1, got {size_bytes!r}")
        pool._check_open()
        self.pool = pool
        self.driver = pool.driver
        self.page_bytes = pool.page_bytes
        self.num_pages = -(-size_bytes // self.page_bytes)
        self.size_bytes = self.num_pages * self.page_bytes
        self.address = self.driver.reserve(self.size_bytes)
        self._mapped: dict[int, int] = {}  # page index -> pool page id
        self._closed = False

    # -- mapping --
    def map(self, page_index: int, page_id: int) -> None:
        """Map pool page ``page_id`` at ``page_index``."""
        self._check_index(page_index)
        if page_index in self._mapped:
            raise AlreadyMappedError(f"page index {page_index} already has pool page "
                                     f"{self._mapped[page_index]} mapped; unmap it first")
        handle = self.pool._handle_for_mapping(page_id)
        self.driver.map(self.address + page_index * self.page_bytes, handle, self.page_bytes)
        self._mapped[page_index] = page_id
        self.pool._count_mapping(page_id, +1)

    def unmap(self, page_index: int) -> int:
        """Unmap ``page_index``; returns the pool page that was there (still allocated)."""
        self._check_index(page_index)
        if page_index not in self._mapped:
            raise NotMappedError(f"page index {page_index} has nothing mapped")
        self.driver.unmap(self.address + page_index * self.page_bytes, self.page_bytes)
        page_id = self._mapped.pop(page_index)
        self.pool._count_mapping(page_id, -1)
        return page_id

    def page_at(self, page_index: int) -> int | None:
        """The pool page mapped at ``page_index``, or None."""
        self._check_index(page_index)
        return self._mapped.get(page_index)

    def is_mapped(self, page_index: int) -> bool:
        return self.page_at(page_index) is not None

    def mapped_pages(self) -> dict[int, int]:
        """page index -> pool page id, for every mapped index (a copy)."""
        self._check_open()
        return dict(self._mapped)

    @property
    def num_mapped_pages(self) -> int:
        return len(self._mapped)

    # -- views --
    def tensor(self, offset_bytes: int = 0, num_bytes: int | None = None, dtype=None, shape=None):
        """A zero-copy torch tensor over bytes [offset_bytes, offset_bytes + num_bytes).

        ``offset_bytes`` and ``num_bytes`` must be multiples of the dtype's element size and lie
        inside the range. Reading bytes that are not mapped faults (host: SIGSEGV), so map
        before you touch. ``shape`` defaults to 1-D.
        """
        import torch
        self._check_open()
        dtype = dtype or torch.uint8
        if num_bytes is None:
            num_bytes = self.size_bytes - offset_bytes
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        if offset_bytes < 0 or num_bytes < 0 or offset_bytes + num_bytes > self.size_bytes:
            raise PageIndexError(f"bytes [{offset_bytes}, {offset_bytes + num_bytes}) lie outside "
                                 f"the range of {self.size_bytes} bytes")
        if offset_bytes % element_bytes or num_bytes % element_bytes:
            raise AlignmentError(f"offset {offset_bytes} and length {num_bytes} bytes must be "
                                 f"multiples of the {dtype} element size {element_bytes}")
        view = self.driver.tensor(self.address + offset_bytes, num_bytes).view(dtype)
        return view if shape is None else view.view(shape)

    def copy_page(self, dst_page_index: int, src_page_index: int) -> None:
        """Copy the bytes of one mapped page to another mapped page of this range."""
        for index in (dst_page_index, src_page_index):
            if not self.is_mapped(index):
                raise NotMappedError(f"page index {index} has nothing mapped; cannot copy")
        self.driver.copy(self.address + dst_page_index * self.page_bytes,
                         self.address + src_page_index * self.page_bytes, self.page_bytes)

    # -- lifecycle --
    def close(self) -> None:
        """Unmap every page (pages stay allocated in the pool) and free the reservation."""
        if self._closed:
            return
        for page_index in sorted(self._mapped):
            self.unmap(page_index)
        self.driver.free_reservation(self.address, self.size_bytes)
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("virtual range used after close()")

    def _check_index(self, page_index: int) -> None:
        self._check_open()
        if not isinstance(page_index, int) or not 0 <= page_index < self.num_pages:
            raise PageIndexError(f"page index {page_index!r} outside the range's "
                                 f"0..{self.num_pages - 1}")

    def __enter__(self) -> "VirtualRange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"VirtualRange(address={self.address:#x}, size_bytes={self.size_bytes}, "
                f"page_bytes={self.page_bytes}, mapped={len(self._mapped)}/{self.num_pages})")
