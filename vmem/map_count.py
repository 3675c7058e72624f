"""The host driver's bound on memory mappings: Linux's ``vm.max_map_count`` (65530 by default).

Every mapped page that does not continue its neighbour's memfd page is one mapping (a VMA) of
the process, and so is each piece of a reservation between two of them. At the limit every
mmap fails with ENOMEM, and so did everything at once: a map ("Cannot allocate memory" with
gigabytes free), then every unmap too (the host driver unmaps by mapping PROT_NONE over the
page), so no range could be closed, and malloc of large blocks (Python's, torch's): the process
was wedged. So the host drivers (all of them: the limit is the process's) refuse a reserve,
a map or a detach (``close()`` under a view: each copy is a mapping of its own, so n
merged pages became n mappings, past any headroom for a large range; a refused one is held,
vmem/vrange.py) that could leave fewer than ``headroom(limit)`` mappings (an eighth of the
limit, at least ``MIN_HEADROOM``) to it, before any system call (DriverCallError naming the
limit), keeping room for unmaps, a forked child's detaches (never refused: refused, the child
would share its parent's page) and the rest of the process.

Counting costs a read of /proc/self/maps, so it is done rarely: after a count, each call takes
from a budget (what the count left above the headroom; a map or a detach makes at most 2 new
mappings, a reserve 1), and only a call the budget cannot cover counts again. Unmaps give
nothing back (one may split a merged run), so the budget errs towards counting again; what the
rest of the process maps between two counts comes out of the headroom.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

from .errors import DriverCallError

MAX_MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"
MIN_HEADROOM = 1024        # malloc's large blocks, thread stacks, torch: mappings too


def max_map_count() -> Optional[int]:
    """``vm.max_map_count``, None when unreadable (not Linux, no /proc)."""
    try:
        with open(MAX_MAP_COUNT_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def mapping_count() -> Optional[int]:
    """The memory mappings this process has now (lines of /proc/self/maps), None when
    unreadable."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def headroom(limit: int) -> int:
    """Mappings kept free below ``limit``: an eighth of it, at least ``MIN_HEADROOM``."""
    return max(MIN_HEADROOM, limit // 8)


class MapCountGuard:
    """Refuses a call that could take the process's mappings within ``headroom`` of
    ``vm.max_map_count`` (module docstring). One per process (``GUARD``): the limit is the
    process's, whichever driver maps."""

    def __init__(self) -> None:
        self._budget = 0           # mappings calls may still make before the next count
        self._lock = threading.Lock()

    def check(self, call: str, new_mappings: int) -> None:
        """DriverCallError naming the limit unless ``new_mappings`` more fit under it."""
        with self._lock:
            self._check(call, new_mappings)

    def _check(self, call: str, new_mappings: int) -> None:
        if new_mappings <= self._budget:
            self._budget -= new_mappings
            return
        limit, count = max_map_count(), mapping_count()
        if limit is None or count is None:
            return                 # unknown: the system call says what it says
        left = limit - headroom(limit) - count
        if new_mappings > left:
            raise DriverCallError(
                f"{call}: this process has {count} memory mappings and Linux allows "
                f"{limit} (vm.max_map_count); vmem keeps {headroom(limit)} of them free (at the "
                f"limit no page could be unmapped again, and malloc fails). Each mapped page "
                f"that does not continue its neighbour's is one mapping: map fewer, larger "
                f"pages (page_bytes), or raise vm.max_map_count (sysctl)")
        self._budget = left - new_mappings


GUARD = MapCountGuard()


def _after_fork_in_child() -> None:
    """A lock another thread held at the fork would stay held in the child."""
    global GUARD
    GUARD = MapCountGuard()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
