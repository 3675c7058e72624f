"""FaultInjectingDriver: a real driver underneath, with chosen calls made to fail.

    driver = FaultInjectingDriver(HostDriver())
    driver.fail_at("map", 3)          # the 4th map call from now raises DriverCallError
    driver.fail_at("create_pages", 0, out_of_memory=True)   # the next pool build is an OOM

Calls are counted per kind (``map``, ``unmap``, ``create_pages``, ``discard_pages``,
``recreate_pages``, ``reserve``, ``copy``) from the moment the fault is armed; the failing call
raises BEFORE it reaches the real driver, so a failed call changes nothing (the same as
CudaDriver, which undoes a half-done cuMemMap). Every other call goes to the wrapped driver
unchanged.

The wrapper also keeps its own record of which addresses are mapped, so a second map of an
address that is already mapped raises ``AlreadyMappedError`` (the host driver's MAP_FIXED would
silently replace it) and is counted in ``double_maps``; and an optional ``delay`` callable runs
inside every map/unmap (tests inject random sleeps there to shake out races).
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable, Optional, Sequence

from .driver import Driver
from .errors import AlreadyMappedError, DriverCallError, NotMappedError, VMemConfigError

FAULT_KINDS = ("map", "unmap", "create_pages", "discard_pages", "recreate_pages", "reserve",
               "copy")


class FaultInjectingDriver(Driver):
    """Wraps ``inner``; ``fail_at(kind, k)`` makes the k-th next call of ``kind`` (0-based) fail.

    Guarantees: a failed call has no effect on the real driver; ``calls[kind]`` counts every call
    of that kind made through the wrapper (failed ones included); ``persistent=True`` makes every
    call from the k-th on fail (a device that stays out of memory).
    """

    def __init__(self, inner: Driver, delay: Optional[Callable[[str], None]] = None) -> None:
        self.inner = inner
        self.name = f"faulty-{inner.name}"
        self.delay = delay
        self.calls: Counter = Counter()
        self.faults_raised: Counter = Counter()
        self.double_maps = 0
        self._armed: dict = {}                  # kind -> (call number that fails, persistent, oom)
        self._mapped: set = set()               # addresses mapped through this wrapper
        self._lock = threading.Lock()
        # the wrapped driver's ledger (a HostDriver's is the process's one host memory): a
        # private one let a pool through the wrapper and one on the bare driver both pass
        # against the same memory (vmem/commits.py)
        self.recent_commits = inner.recent_commits

    # -- arming --
    def fail_at(self, kind: str, call: int, *, persistent: bool = False,
                out_of_memory: bool = False) -> None:
        """Make call number ``call`` (0 = the next one) of ``kind`` raise DriverCallError."""
        if kind not in FAULT_KINDS:
            raise VMemConfigError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        if not isinstance(call, int) or call < 0:
            raise VMemConfigError(f"fault call number must be an int >= 0, got {call!r}")
        with self._lock:
            self._armed[kind] = (self.calls[kind] + call, persistent, out_of_memory)

    def disarm(self, kind: Optional[str] = None) -> None:
        """Remove the fault on ``kind`` (all kinds when None)."""
        with self._lock:
            if kind is None:
                self._armed.clear()
            else:
                self._armed.pop(kind, None)

    def _enter(self, kind: str) -> None:
        with self._lock:
            number = self.calls[kind]
            self.calls[kind] += 1
            armed = self._armed.get(kind)
            fail = armed is not None and (number == armed[0] or (armed[1] and number > armed[0]))
            if fail:
                self.faults_raised[kind] += 1
                if not armed[1]:
                    del self._armed[kind]
        if fail:
            what = "out of memory (injected)" if armed[2] else "injected fault"
            raise DriverCallError(f"{kind}: {what} at call {number}")

    # -- the Driver interface --
    @property
    def granularity_bytes(self) -> int:
        return self.inner.granularity_bytes

    @property
    def device(self) -> str:
        return self.inner.device

    @property
    def pages_in_host_memory(self) -> bool:
        return self.inner.pages_in_host_memory

    def available_bytes(self) -> Optional[int]:
        return self.inner.available_bytes()

    def reserve(self, size_bytes: int) -> int:
        self._enter("reserve")
        return self.inner.reserve(size_bytes)

    def free_reservation(self, address: int, size_bytes: int) -> None:
        self.inner.free_reservation(address, size_bytes)

    def create_pages(self, num_pages: int, page_bytes: int,
                     discarded: bool = False) -> Sequence[Any]:
        self._enter("create_pages")
        return self.inner.create_pages(num_pages, page_bytes, discarded)

    def release_pages(self, handles: Sequence[Any], discarded: Sequence[Any] = ()) -> None:
        self.inner.release_pages(handles, discarded)

    def discard_pages(self, handles: Sequence[Any], page_bytes: int) -> None:
        self._enter("discard_pages")
        self.inner.discard_pages(handles, page_bytes)

    def recreate_pages(self, handles: Sequence[Any], page_bytes: int) -> Sequence[Any]:
        self._enter("recreate_pages")
        return self.inner.recreate_pages(handles, page_bytes)

    def map(self, address: int, handle: Any, page_bytes: int) -> None:
        self._enter("map")
        if self.delay is not None:
            self.delay("map")
        with self._lock:
            if address in self._mapped:
                self.double_maps += 1
                raise AlreadyMappedError(f"address {address:#x} is already mapped (mapped twice)")
            self._mapped.add(address)
        try:
            self.inner.map(address, handle, page_bytes)
        except BaseException:
            with self._lock:
                self._mapped.discard(address)
            raise

    def unmap(self, address: int, page_bytes: int) -> None:
        self._enter("unmap")
        if self.delay is not None:
            self.delay("unmap")
        with self._lock:
            if address not in self._mapped:
                raise NotMappedError(f"address {address:#x} is not mapped")
        self.inner.unmap(address, page_bytes)
        with self._lock:
            self._mapped.discard(address)

    def unmap_if_mapped(self, address: int, page_bytes: int) -> bool:
        """False, no call counted, when nothing is mapped at ``address`` through this wrapper;
        else an ``unmap`` (counted, failing when armed). The default took any refusal for
        "nothing mapped": an injected fault left the mapping in place and returned False
        (an undone map stayed mapped), and an address never mapped used up an armed fault."""
        with self._lock:
            if address not in self._mapped:
                return False
        self.unmap(address, page_bytes)
        return True

    def tensor(self, address: int, num_bytes: int, on_release=None):
        return self.inner.tensor(address, num_bytes, on_release=on_release)

    def detach(self, address: int, handle: Any, page_bytes: int, copy: bool = True) -> bool:
        detached = self.inner.detach(address, handle, page_bytes, copy)
        if detached:             # no longer a mapping of a pool page
            with self._lock:
                self._mapped.discard(address)
        return detached

    def close_inherited(self, handles: Sequence[Any]) -> None:
        self.inner.close_inherited(handles)

    def _after_fork_in_child(self) -> None:
        super()._after_fork_in_child()
        self.inner._after_fork_in_child()

    def prepare_unmap(self, num_unmaps: int) -> None:
        self.inner.prepare_unmap(num_unmaps)

    def copy(self, dst_address: int, src_address: int, num_bytes: int) -> None:
        self._enter("copy")
        self.inner.copy(dst_address, src_address, num_bytes)

    def close(self) -> None:
        self.inner.close()

    @property
    def mapped_addresses(self) -> int:
        """How many addresses are mapped through this wrapper now."""
        with self._lock:
            return len(self._mapped)
