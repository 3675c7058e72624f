"""The argument checks every vmem entry point shares: a size, offset, count, page id or page
index is an int (anything ``operator.index`` takes, numpy integers included; never a bool) in
its range, else a typed error that names the argument, raised before any driver call.

Why sizes have a ceiling: the host driver hands sizes to mmap as a ctypes ``size_t``, which
keeps only the low 64 bits, so ``VirtualRange(pool, 2**64 + 4096)`` reserved 4 KiB while the
range believed it held 2**52 pages, and a map past those 4 KiB replaced someone else's memory.
No size reaches a driver past ``MAX_BYTES``:

    MAX_BYTES = 2**47 (128 TiB)   the user address space mmap(NULL, ...) hands out on x86-64
                                  Linux (aarch64: 2**48), so no reservation, page or pool past
                                  it could ever be mapped here; on a GPU it is far past any
                                  device's memory and inside CUDA's 49-bit address space
"""
from __future__ import annotations

import operator
from typing import Optional

from .errors import AlignmentError, PageStateError, VMemConfigError

MAX_BYTES = 2**47


def as_int(value, name: str, error: type = VMemConfigError) -> int:
    """``value`` as a Python int, else ``error`` naming ``name`` and the type given."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise error(f"{name} must be an int, got {type(value).__name__} {value!r}")


def check_flag(value, name: str, error: type = VMemConfigError) -> bool:
    """``value`` when it is True or False, else ``error`` naming ``name`` (a truthy "no" or 1
    switched the option on)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {type(value).__name__} "
                    f"{repr(value)[:60]}")
    return value


def check_index(value, bound: int, name: str, owner: str, error: type) -> int:
    """``value`` as an int in ``0..bound - 1``, else ``error``: its message names the type of
    a value that is no int (a float, a bool), the range of one outside it ("page id 4 outside
    the pool's 0..3": ``name`` "page id", ``owner`` "the pool's")."""
    index = as_int(value, name, error)
    if not 0 <= index < bound:
        raise error(f"{name} {index} outside {owner} 0..{bound - 1}")
    return index


def id_list(pages) -> list:
    """One page id, or an iterable of them, as a list (each still to check); PageStateError
    when ``pages`` is neither."""
    if isinstance(pages, bool):
        return [pages]            # refused by the id check, as a bool, not as an iterable
    try:
        return [operator.index(pages)]
    except TypeError:
        pass
    try:
        return list(pages)
    except TypeError:
        raise PageStateError(f"pages must be a page id or an iterable of them, got "
                             f"{pages!r}") from None


def check_bytes(value, name: str, granularity: int, driver: str) -> int:
    """``value`` as an int: a positive multiple of ``granularity`` bytes, at most ``MAX_BYTES``
    (VMemConfigError past it or not an int, AlignmentError off the granularity)."""
    size = as_int(value, name)
    check_ceiling(size, name)
    if size <= 0 or size % granularity:
        raise AlignmentError(f"{name} {size!r} bytes is not a positive multiple of the {driver} "
                             f"driver's granularity of {granularity} bytes")
    return size


def check_ceiling(size: int, name: str) -> None:
    """VMemConfigError when ``size`` bytes is past ``MAX_BYTES`` (module docstring)."""
    if size > MAX_BYTES:
        raise VMemConfigError(f"{name} {size} bytes is past the {MAX_BYTES} bytes (128 TiB) "
                              f"vmem allows: the user address space of x86-64 Linux, where no "
                              f"larger range could be mapped")


def check_count(value, what: str, least: int = 0, most: Optional[int] = None) -> int:
    """``value`` as an int in ``least..most`` (no upper bound when None), else VMemConfigError
    saying ``what`` and the range."""
    try:
        count = as_int(value, what)
    except VMemConfigError:
        count = None
    if count is None or count < least or (most is not None and count > most):
        bounds = f">= {least}" if most is None else f"in {least}..{most}"
        raise VMemConfigError(f"{what} {bounds}, got {value!r}")
    return count
