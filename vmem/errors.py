"""Typed errors of the vmem package.

Every error names the offending value and the limit it broke, and is raised before any state
changes: after a VMemError the driver, pool and range are exactly as they were.
"""


class VMemError(Exception):
    """Base class of every error raised by ``vmem``."""


class AlignmentError(VMemError, ValueError):
    """A size or offset is not a multiple of the page size or the driver's granularity."""


class PageIndexError(VMemError, IndexError):
    """A page index lies outside a virtual range."""


class AlreadyMappedError(VMemError, ValueError):
    """A page index that already has a physical page mapped was mapped again."""


class NotMappedError(VMemError, ValueError):
    """A page index with nothing mapped was unmapped."""


class PoolExhaustedError(VMemError, MemoryError):
    """The physical page pool has fewer free pages than were asked for."""


class InsufficientMemoryError(VMemError, MemoryError):
    """Creating pages would need more physical memory than the device has available now; raised
    before any page is created (the message gives both sizes in bytes)."""


class PageStateError(VMemError, ValueError):
    """A physical page is used in a state that forbids it: releasing one that is still mapped
    or already free, or mapping one that was never allocated from its pool."""


class ClosedError(VMemError, RuntimeError):
    """A driver, pool or range was used after ``close()``."""


class ForkedError(VMemError, RuntimeError):
    """A driver, pool or range was used in a process forked from the one that made it. The
    child's copies are cut off from the parent's pages at the fork (``vmem/forks.py``); open a
    new driver in the child instead."""


class DriverUnavailableError(VMemError, RuntimeError):
    """The requested driver cannot run here (no GPU, no cuda-python, not Linux)."""


class DriverCallError(VMemError, OSError):
    """An operating-system or CUDA call failed; the message names the call and the error."""


class VMemConfigError(VMemError, ValueError):
    """A configuration value (driver name, page count) is outside what is allowed."""
