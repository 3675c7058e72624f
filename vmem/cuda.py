"""CudaDriver: the CUDA driver's virtual-memory API through cuda-python.

    granularity    cuMemGetAllocationGranularity(MINIMUM)   (2 MiB on current GPUs)
    reserve        cuMemAddressReserve
    create pages   cuMemCreate, pinned device memory, all of them up front (discarded: None
                   placeholders, for recreate_pages)
    map            cuMemMap + cuMemSetAccess(read/write for this device)
    unmap          cuCtxSynchronize + cuMemUnmap: kernels already queued may still read the
                   page, and cuMemUnmap does not wait for them (PyTorch's expandable segments
                   synchronise before unmapping for the same reason). A plan synchronises once
                   (``prepare_unmap(n)``) and its next n unmaps on that thread skip their own
                   cuCtxSynchronize, so queued work is waited for once per plan, not per page
    release        cuMemRelease / cuMemAddressFree
    discard pages  cuMemRelease (the handle is dead: never released again)
    recreate       cuMemCreate: new handles, all or nothing
    tensor         a DLPack capsule naming cuda:<index> (vmem/dlpack.py), zero copy

It runs in the primary context PyTorch created on the device (retained at open, made current
on whichever thread calls and the thread's previous context restored after, released at close;
a device without virtual memory management is refused at open), so tensors made by PyTorch and addresses mapped
here are interchangeable. cuda-python is imported lazily: importing ``vmem``
never needs it. Any CUresult other than CUDA_SUCCESS becomes a DriverCallError naming the call
and the CUDA error name (e.g. CUDA_ERROR_OUT_OF_MEMORY).
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Sequence

from . import checks, commits
from .dlpack import DLPACK_CUDA, tensor_at
from .driver import Driver
from .errors import ClosedError, DriverCallError, DriverUnavailableError


def _import_bindings():
    try:
        from cuda.bindings import driver as cu  # cuda-python >= 12.6
    except ImportError:
        from cuda import cuda as cu  # older cuda-python layout
    return cu


def cuda_unavailable_reason() -> str | None:
    """None when the CUDA driver can run here, else why not (no GPU, or no cuda-python)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
    try:
        _import_bindings()
    except ImportError:
        return "cuda-python is not installed (pip install 'vmemkv[cuda]')"
    return None


class CudaDriver(Driver):
    """CUDA VMM on one device. Tensors live on ``cuda:<index>``."""

    name = "cuda"

    def __init__(self, device_index: int | None = None) -> None:
        reason = cuda_unavailable_reason()
        if reason:
            raise DriverUnavailableError(f"CUDA driver unavailable: {reason}")
        import torch
        index = torch.cuda.current_device() if device_index is None else device_index
        with torch.cuda.device(index):
            torch.empty(1, device=f"cuda:{index}")  # make PyTorch create its context
        self._bind(_import_bindings(), index)
        self._open_device()

    def _bind(self, cu: Any, index: int) -> None:
        """Keep the bindings module and build the allocation and access descriptors for
        device ``index`` (pinned device memory, read/write for this device). No driver call."""
        self._cu, self._index = cu, index
        self.recent_commits = commits.of_device(f"cuda:{index}")
        self._prop = cu.CUmemAllocationProp()
        self._prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def _open_device(self) -> None:
        """cuInit; retain the device's primary context (the one PyTorch runs in); read the
        granularity."""
        cu = self._cu
        self._check("cuInit", cu.cuInit(0))
        self._cu_device = self._check("cuDeviceGet", cu.cuDeviceGet(self._index))
        self._check_vmm_supported()
        self._context = self._check("cuDevicePrimaryCtxRetain",
                                    cu.cuDevicePrimaryCtxRetain(self._cu_device))
        with self._with_context():
            self._granularity = self._query_granularity()

    def _check_vmm_supported(self) -> None:
        """DriverUnavailableError unless the device supports cuMemCreate/cuMemMap (some vGPU and
        older devices do not; the driver would fail later, on the first page)."""
        cu = self._cu
        attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        if not self._check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attribute, self._cu_device)):
            raise DriverUnavailableError(
                f"CUDA driver unavailable: device {self._index} does not support virtual memory "
                f"management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)")

    def _query_granularity(self) -> int:
        cu = self._cu
        return int(self._check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
            self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def _check(self, call: str, result: Any) -> Any:
        """Unpack a cuda-python (CUresult, values...) tuple, raising on any error."""
        if not isinstance(result, tuple):
            result = (result,)
        status, values = result[0], result[1:]
        if status != self._cu.CUresult.CUDA_SUCCESS:
            name = getattr(status, "name", None) or f"CUresult {status!r}"
            raise DriverCallError(f"{call} failed with {name} ({int(status)})")
        return values[0] if len(values) == 1 else (values or None)

    @contextmanager
    def _with_context(self):
        """Make the primary context current on the calling thread first. A thread PyTorch has
        not used (the background mapper's) has no current context, and the driver API acts on
        the calling thread's context. A thread that had another context current (another
        device's) gets it back afterwards, so torch's current device is never changed; a thread
        with none keeps ours (no second switch per call on the mapper thread)."""
        self._check_not_forked()     # a CUDA context does not survive fork()
        if self._context is None:
            raise ClosedError("this CudaDriver is closed")
        current = self._check("cuCtxGetCurrent", self._cu.cuCtxGetCurrent())
        switched = current is None or int(current) != int(self._context)
        if switched:
            self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._context))
        try:
            yield
        finally:
            if switched and current is not None and int(current) != 0:
                self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(current))

    def close(self) -> None:
        """Release our reference to the primary context (PyTorch keeps its own); in a forked
        child only forgets it (no driver call can run there)."""
        if self._forked:
            self._context = None
        if getattr(self, "_context", None) is not None:
            self._context = None
            self._check("cuDevicePrimaryCtxRelease", self._cu.cuDevicePrimaryCtxRelease(self._cu_device))

    @property
    def granularity_bytes(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        return f"cuda:{self._index}"

    def available_bytes(self) -> int | None:
        with self._with_context():
            free, _total = self._check("cuMemGetInfo", self._cu.cuMemGetInfo())
        return int(free)

    def reserve(self, size_bytes: int) -> int:
        size_bytes = self.check_bytes(size_bytes, "reserve size_bytes")
        with self._with_context():
            address = self._check("cuMemAddressReserve",
                                  self._cu.cuMemAddressReserve(size_bytes, self._granularity, 0, 0))
        return int(address)

    def free_reservation(self, address: int, size_bytes: int) -> None:
        size_bytes = self.check_bytes(size_bytes, "free_reservation size_bytes")
        with self._with_context():
            self._check("cuMemAddressFree", self._cu.cuMemAddressFree(address, size_bytes))

    def create_pages(self, num_pages: int, page_bytes: int,
                     discarded: bool = False) -> Sequence[Any]:
        num_pages, page_bytes = self._check_pages(num_pages, page_bytes)
        if discarded:                # nothing to name yet: recreate_pages makes real ones
            return [None] * num_pages
        handles = []
        with self._with_context():
            try:
                for _ in range(num_pages):
                    handles.append(self._check("cuMemCreate",
                                               self._cu.cuMemCreate(page_bytes, self._prop, 0)))
            except DriverCallError:
                self.release_pages(handles)  # all or nothing: no page leaks on OOM
                raise
        return handles

    def release_pages(self, handles: Sequence[Any], discarded: Sequence[Any] = ()) -> None:
        with self._with_context():   # discarded handles were released by discard_pages
            for handle in handles:
                self._check("cuMemRelease", self._cu.cuMemRelease(handle))

    def discard_pages(self, handles: Sequence[Any], page_bytes: int) -> None:
        self.release_pages(handles)

    def recreate_pages(self, handles: Sequence[Any], page_bytes: int) -> Sequence[Any]:
        return self.create_pages(len(handles), page_bytes)

    def map(self, address: int, handle: Any, page_bytes: int) -> None:
        page_bytes = self.check_bytes(page_bytes)
        with self._with_context():
            self._check("cuMemMap", self._cu.cuMemMap(address, page_bytes, 0, handle, 0))
            try:
                self._check("cuMemSetAccess",
                            self._cu.cuMemSetAccess(address, page_bytes, [self._access], 1))
            except DriverCallError:
                self._cu.cuMemUnmap(address, page_bytes)  # never leave a mapping half done
                raise

    def prepare_unmap(self, num_unmaps: int) -> None:
        """Wait for every kernel queued so far (one cuCtxSynchronize, only when
        ``num_unmaps > 0``); the next ``num_unmaps`` unmaps on this thread then skip their own.
        Replaces any earlier credit on this thread."""
        self._unmap_credit().left = 0
        if num_unmaps > 0:
            with self._with_context():
                self._check("cuCtxSynchronize", self._cu.cuCtxSynchronize())
            self._unmap_credit().left = num_unmaps

    def _unmap_credit(self):
        if "_credits" not in self.__dict__:
            self._credits = threading.local()
        return self._credits

    def unmap(self, address: int, page_bytes: int) -> None:
        self._unmap(address, page_bytes, if_mapped=False)

    def unmap_if_mapped(self, address: int, page_bytes: int) -> bool:
        """``unmap``; False when cuMemUnmap refuses (nothing mapped there: it changes nothing).
        Any other failure is raised: the default took a failed synchronise before cuMemUnmap
        (a sticky CUDA error) for "nothing mapped", and an undone map stayed mapped."""
        return self._unmap(address, page_bytes, if_mapped=True)

    def _unmap(self, address: int, page_bytes: int, if_mapped: bool) -> bool:
        page_bytes = self.check_bytes(page_bytes)
        credit = self._unmap_credit()
        left = getattr(credit, "left", 0)
        # an unmap while an exception is handled is a rollback: it may undo pages kernels
        # queued after prepare_unmap already use, so it synchronises, and the credit is gone
        synced = left > 0 and sys.exc_info()[0] is None
        credit.left = left - 1 if synced else 0
        with self._with_context():
            if not synced:
                self._check("cuCtxSynchronize", self._cu.cuCtxSynchronize())
            result = self._cu.cuMemUnmap(address, page_bytes)
            status = result[0] if isinstance(result, tuple) else result
            if if_mapped and status != self._cu.CUresult.CUDA_SUCCESS:
                return False
            self._check("cuMemUnmap", result)
        return True

    def tensor(self, address: int, num_bytes: int, on_release=None):
        import torch
        num_bytes = checks.check_count(num_bytes, "tensor takes num_bytes", most=checks.MAX_BYTES)
        self._check_not_forked()
        if num_bytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return tensor_at(address, num_bytes, DLPACK_CUDA, self._index, on_release=on_release)
