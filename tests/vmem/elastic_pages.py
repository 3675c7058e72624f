"""Helpers of the elastic-page tests (issue 32): a real driver that records what it created
and released, and a pool's page counts in one tuple."""
from __future__ import annotations

import os

from vmemkv.vmem.faults import FaultInjectingDriver


class ElasticDriver(FaultInjectingDriver):
    """A real driver that records the pages it created and what ``release_pages`` was given,
    and reports ``available`` bytes when set (the machine is untouched)."""

    def __init__(self, inner, available: int | None = None) -> None:
        super().__init__(inner)
        self.available = available
        self.created: list = []
        self.released: list = []      # (live handles, discarded handles) per call

    def available_bytes(self):
        return self.inner.available_bytes() if self.available is None else self.available

    def create_pages(self, num_pages, page_bytes, discarded=False):
        handles = super().create_pages(num_pages, page_bytes, discarded)
        self.created.extend(handles)
        return handles

    def release_pages(self, handles, discarded=()):
        self.released.append((list(handles), list(discarded)))
        super().release_pages(handles, discarded)

    def memfd_bytes(self) -> int:
        """Bytes the host memfds of this driver's pages hold now (while their pool is open)."""
        return sum(os.fstat(fd).st_blocks * 512 for fd in {page.fd for page in self.created})


def counts(pool) -> tuple:
    return (pool.total_pages, pool.committed_pages, pool.discarded_pages, pool.free_pages,
            pool.mapped_pages, pool.committed_bytes)
