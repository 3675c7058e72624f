"""How much memory a device has and has free, and the checks every cache runs before committing.

    total      host: MemTotal of /proc/meminfo      CUDA: the GPU's total memory
    available  host: MemAvailable (what can be committed without swapping or the OOM killer)
               CUDA: free memory (torch.cuda.mem_get_info)

A request above *total* could never be built; one above *available* would push the machine
into swap or the OOM killer. Both are refused with ``CacheTooLargeError`` (a MemoryError and a
CacheConfigError) before anything is allocated, the message giving both sizes in bytes.

A vmem pool grown by ``resize_cache`` creates its pages only when they are first mapped, and a
swap space (``swap_bytes``) is host memory each swap-out allocates its buffer from: the bytes an
engine may use and has not created yet are *promised*, and not out of the available memory yet.
Every engine in this process is tracked (``track_promises``), and every check of a request
against the available memory here subtracts the other engines' promises on that device
(``promised_bytes``), so several engines in one process never promise more than it has.
``PROMISES_LOCK`` makes each check and what it admits one step: a resize holds it across its
check and the size change, a construction from its first check until the engine is tracked.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Optional, Protocol

import torch

from vmemkv.vmem.host import address_space_left_bytes, meminfo_bytes

from .errors import CacheConfigError, CacheTooLargeError


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Total memory of ``device`` in bytes, None when it cannot be read."""
    return _memory_bytes(device, total=True)


def available_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory of ``device`` that can be committed now, in bytes, None when it cannot be read."""
    return _memory_bytes(device, total=False)


def _memory_bytes(device: torch.device, total: bool) -> Optional[int]:
    device = torch.device(device)
    if device.type == "cuda":
        try:
            free, whole = torch.cuda.mem_get_info(device)
        except (RuntimeError, ValueError, AssertionError):
            return None
        return int(whole if total else free)
    return meminfo_bytes("MemTotal" if total else "MemAvailable")


class PromisesMemory(Protocol):
    """An owner of memory created on demand (an engine: its resizable vmem pool on the cache's
    device, its swap space on the host)."""

    def promised_bytes(self, device: torch.device) -> int:
        """Bytes of ``device`` memory it may fill on demand and has not created yet (0 on
        another device, or once closed)."""


# the live owners (weak: one collected stops counting); PROMISES_LOCK is held by a resize
# across its check and the size change, and by a construction from its first check until its
# engine is tracked (or the construction failed), so two threads never both pass against the
# same bytes
_promisers: "weakref.WeakSet[PromisesMemory]" = weakref.WeakSet()
_promisers_lock = threading.Lock()
PROMISES_LOCK = threading.RLock()


def track_promises(owner: PromisesMemory) -> None:
    """Count ``owner``'s promises in every check from now on (until ``forget_promises`` or its
    collection)."""
    with _promisers_lock:
        _promisers.add(owner)


def forget_promises(owner: PromisesMemory) -> None:
    """Stop counting ``owner``'s promises (closed, or its construction failed). Idempotent."""
    with _promisers_lock:
        _promisers.discard(owner)


def promised_bytes(device: torch.device, excluding: Optional[PromisesMemory] = None) -> int:
    """Bytes of ``device`` memory the tracked owners but ``excluding`` (whose request counts
    its own) have promised and not created yet."""
    with _promisers_lock:
        owners = [owner for owner in _promisers if owner is not excluding]
    return sum(owner.promised_bytes(device) for owner in owners)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device's memory ("cuda" is the current GPU)."""
    return _device_key(a) == _device_key(b)


def _device_key(device: torch.device) -> tuple:
    device = torch.device(device)
    if device.type == "cpu":
        return ("cpu",)
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def unpromised_available_bytes(device: torch.device,
                               excluding: Optional[PromisesMemory] = None) -> Optional[int]:
    """``available_memory_bytes`` less ``promised_bytes`` (at least 0): what a new request may
    take now; None when the available memory cannot be read."""
    return _available_check(device, excluding)[1]


def _available_check(device: torch.device,
                     excluding: Optional[PromisesMemory]) -> tuple[str, Optional[int]]:
    """(what the limit is called, the limit): the available memory less the promises."""
    available = available_memory_bytes(device)
    promised = promised_bytes(device, excluding) if available is not None else 0
    if not promised:
        return _where(device, False), available
    return (f"{_where(device, False)} ({available} bytes) less the {promised} bytes other KV "
            f"pools in this process promised and have not created yet (grown pools' pages not "
            f"mapped yet, swap spaces not filled yet)", max(0, available - promised))


def _where(device: torch.device, total: bool) -> str:
    if device.type == "cpu":
        return "host MemTotal" if total else "host MemAvailable"
    return f"{device} total memory" if total else f"{device} free memory"


def check_fits_device(what: str, num_bytes: int, device: torch.device,
                      committed: bool = True, available_bytes: Optional[int] = None,
                      remedy: str = "lower cache_bytes (or use memory_utilization)",
                      promiser: Optional[PromisesMemory] = None) -> None:
    """Raise CacheTooLargeError, before anything is allocated, when ``num_bytes`` exceeds the
    device's total memory, or (``committed``: the bytes are committed now, not on demand) its
    available memory (``available_bytes`` when the caller has it, else read now, less what the
    tracked pools but ``promiser``, whose own promise ``num_bytes`` counts, promised). On CUDA it
    reads ``device`` from this process: call it where ``device`` is in use (a check of another
    GPU opens a CUDA context there, hundreds of MiB, until the process ends)."""
    device = torch.device(device)
    checks = [(_where(device, True), device_memory_bytes(device))]
    if committed:
        checks.append(_available_check(device, promiser) if available_bytes is None
                      else (_where(device, False), available_bytes))
    if device.type == "cpu":   # ulimit -v bounds what can be mapped at all, committed or not
        checks.append(("address space left under ulimit -v (RLIMIT_AS)", address_space_left_bytes()))
    for where, limit in checks:
        if limit is not None and num_bytes > limit:
            raise CacheTooLargeError(
                f"{what} needs {num_bytes} bytes ({num_bytes / 2**30:.2f} GiB) but the "
                f"{where} is {limit} bytes ({limit / 2**30:.2f} GiB); {remedy}")


# a vmem pool page's tables on the host: the manager's ledger and slot tables, the PagePool's
# records (tracemalloc: 550-620 bytes a page for pools of 30,000-120,000 pages, 2026-12-06)
TABLE_BYTES_PER_POOL_PAGE = 1024
TABLE_BYTES_PER_BLOCK = 256   # a paged manager's block (tracemalloc: 64-72 bytes, 2026-12-06)


def check_tables_fit(units: int, why: str, unit_bytes: int = TABLE_BYTES_PER_POOL_PAGE,
                     unit: str = "pool pages") -> None:
    """Raise CacheTooLargeError before a manager (and pool) of ``units`` page ids or blocks
    is built when their host tables (``unit_bytes`` each) would not fit the host: they are
    built for every id at once, up to ``max_cache_bytes`` (vmem)."""
    check_fits_device(f"the host tables of {units} {unit} ({why})", units * unit_bytes,
                      torch.device("cpu"), remedy="lower max_cache_bytes / cache_bytes, or use "
                                                  "larger pages or blocks")


def check_swap_fits(swap_bytes: int, device: torch.device, cache_bytes: int = 0,
                    copies: int = 1) -> None:
    """Raise CacheTooLargeError, before anything is allocated, when the swap space does not fit
    the host: it is host memory (pinned on CUDA) that swapped-out sequences fill on demand, so
    it is checked as a cache is, against the host's total and available memory, beside the
    cache's ``cache_bytes`` when the cache is on the host too, times ``copies`` (the
    tensor-parallel ranks that each hold both on this machine)."""
    if not swap_bytes:
        return
    cache_on_host = torch.device(device).type == "cpu"
    total = copies * (swap_bytes + (cache_bytes if cache_on_host else 0))
    each = " each" if copies > 1 else ""
    what = (f"{copies} tensor-parallel ranks' swap spaces" if copies > 1 else "the swap space")
    what += f" (swap_bytes={swap_bytes}{each})"
    if cache_on_host:
        caches = "their KV caches" if copies > 1 else "the KV cache"
        what += f" beside {caches} ({cache_bytes} bytes{each})"
    check_fits_device(what, total, torch.device("cpu"), remedy="lower swap_bytes")


def check_fraction(name: str, value) -> None:
    """Raise CacheConfigError unless ``value`` is a number in (0, 1]."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value)
            or not 0.0 < value <= 1.0):
        raise CacheConfigError(f"{name} must be a fraction in (0, 1], got {value!r}")


def bytes_from_fraction(fraction: float, device: torch.device,
                        promiser: Optional[PromisesMemory] = None) -> int:
    """``fraction`` of the device's available memory, in bytes (vLLM's gpu_memory_utilization,
    but of what is free now, on the host as on a GPU), less what the tracked pools but
    ``promiser`` promised (``unpromised_available_bytes``)."""
    check_fraction("memory_utilization", fraction)
    device = torch.device(device)
    available = unpromised_available_bytes(device, promiser)
    if available is None:
        raise CacheConfigError(f"memory_utilization needs the available memory of {device}, "
                               f"which cannot be read here; pass cache_bytes instead")
    granted = int(available * fraction)
    if granted < 1:
        raise CacheConfigError(f"memory_utilization={fraction} of the {available} bytes "
                               f"available on {device} is less than a byte; give a larger "
                               f"fraction or cache_bytes")
    return granted
