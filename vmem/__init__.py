"""vmem: reserve contiguous virtual address ranges and map physical pages under them on demand.

Two drivers with the same semantics: ``HostDriver`` (Linux mmap + memfd, the default, CPU
tensors) and ``CudaDriver`` (CUDA driver VMM through cuda-python, CUDA tensors). ``PagePool``
owns a fixed budget of physical pages; ``VirtualRange`` maps them at page indices and gives
zero-copy torch views. Importing this package needs neither torch nor cuda-python.
"""
from .driver import Driver, available_drivers, open_driver
from .errors import (AlignmentError, AlreadyMappedError, ClosedError, DriverCallError,
                     DriverUnavailableError, ForkedError, InsufficientMemoryError, NotMappedError, PageIndexError, PageStateError,
                     PoolExhaustedError, VMemConfigError, VMemError)
from .pool import PagePool
from .vrange import VirtualRange

__all__ = [
    "Driver", "open_driver", "available_drivers", "PagePool", "VirtualRange",
    "VMemError", "VMemConfigError", "AlignmentError", "PageIndexError", "AlreadyMappedError",
    "NotMappedError", "PoolExhaustedError", "PageStateError", "ClosedError",
    "DriverUnavailableError", "DriverCallError", "InsufficientMemoryError", "ForkedError",
]
