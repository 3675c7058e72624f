"""What a forked child may do with its parent's vmem objects: let them go, and nothing else.

A host page is a memfd mapped ``MAP_SHARED`` and a CUDA context does not survive ``fork()``, so
a child (gunicorn ``--preload``, multiprocessing's "fork" start method) writing through its copy
of a parent's range would write the parent's KV. ``os.register_at_fork`` runs, at every fork:

    before fork     every live pool's lock is taken: no map or unmap is half done when the
                    address space is copied (a lock held by another thread would stay held in
                    the child forever)
    in the parent   the locks are released; nothing else changes
    in the child    the locks are released; every range's mapped pages are remapped private
                    (host: a copy-on-write mapping of the memfd page, so even a raw tensor view
                    in the child writes only the child's copy; a page held for a view whose pool
                    was closed since, its file gone: a copy; CUDA: nothing, no driver call can
                    run in a child), every pool closes the child's copies of its page files,
                    and every driver, pool and range refuses what touches pages or mappings
                    (``ForkedError``); bookkeeping queries, ``release`` and ``close`` still work
                    and free only the child's copies
    in a grandchild nothing more: its parent cut them off already, and the fd numbers of
                    the memfds it closed may name its other files now

The parent is never affected: the child's views read the pages as they are until the child
writes one (then that page is the child's own).
"""
from __future__ import annotations

import os
import weakref
from typing import List

from . import commits
from .errors import ForkedError

_drivers: "weakref.WeakSet" = weakref.WeakSet()
_pools: "weakref.WeakSet" = weakref.WeakSet()
_ranges: "weakref.WeakSet" = weakref.WeakSet()
_held: List = []        # the pools whose locks the forking thread holds across fork()


def track_driver(driver) -> None:
    _drivers.add(driver)


def track_pool(pool) -> None:
    _pools.add(pool)


def track_range(vrange) -> None:
    _ranges.add(vrange)


def forked_error(what: str) -> ForkedError:
    return ForkedError(f"this {what} belongs to the process that created it; a forked child "
                       f"(pid {os.getpid()}) cannot use it: open a new driver in the child "
                       f"(vmem.open_driver)")


def _before_fork() -> None:
    pools = sorted(_pools, key=id)          # one order for every fork: no lock cycles
    for pool in pools:
        pool._lock.lock.acquire()
    _held[:] = pools


def _release_held() -> None:
    pools, _held[:] = list(_held), []
    for pool in reversed(pools):
        pool._lock.lock.release()


def _after_fork_in_child() -> None:
    _release_held()
    commits._after_fork_in_child()
    for driver in list(_drivers):           # first: a driver's lock is new before ranges use it
        driver._after_fork_in_child()
    for vrange in list(_ranges):            # before pools: remapping needs the page files open
        vrange._after_fork_in_child()
    for pool in list(_pools):
        pool._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_release_held,
                        after_in_child=_after_fork_in_child)
