"""CudaDriver: the CUDA driver's virtual-memory API through cuda-python.

    granularity    cuMemGetAllocationGranularity(MINIMUM)   (2 MiB on current GPUs)
    reserve        cuMemAddressReserve
    create pages   cuMemCreate, pinned device memory, all of them up front
    map            cuMemMap + cuMemSetAccess(read/write for this device)
    unmap          cuMemUnmap
    release        cuMemRelease / cuMemAddressFree
    tensor         __cuda_array_interface__, zero copy

It runs in the primary context PyTorch created on the device, so tensors made by PyTorch and
addresses mapped here are interchangeable. cuda-python is imported lazily: importing ``vmem``
never needs it. Any CUresult other than CUDA_SUCCESS becomes a DriverCallError naming the call
and the CUDA error name (e.g. CUDA_ERROR_OUT_OF_MEMORY).
"""
from __future__ import annotations

from typing import Any, Sequence

from .driver import Driver
from .errors import DriverCallError, DriverUnavailableError


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


class _CudaArrayView:
    """The minimum an object needs for torch.as_tensor to wrap device memory without a copy."""

    def __init__(self, address: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,), "typestr": "|u1", "data": (address, False),
            "version": 3, "strides": None,
        }


class CudaDriver(Driver):
    """CUDA VMM on one device. Tensors live on ``cuda:<index>``."""

    name = "cuda"

    def __init__(self, device_index: int | None = None) -> None:
        reason = cuda_unavailable_reason()
        if reason:
            raise DriverUnavailableError(f"CUDA driver unavailable: {reason}")
        import torch
        self._cu = _import_bindings()
        self._index = torch.cuda.current_device() if device_index is None else device_index
        with torch.cuda.device(self._index):
            torch.empty(1, device=f"cuda:{self._index}")  # make PyTorch create its context
        self._check("cuInit", self._cu.cuInit(0))
        cu = self._cu
        self._prop = cu.CUmemAllocationProp()
        self._prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self._index
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = self._index
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._granularity = int(self._check("cuMemGetAllocationGranularity",
            cu.cuMemGetAllocationGranularity(
                self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def _check(self, call: str, result: Any) -> Any:
        """Unpack a cuda-python (CUresult, values...) tuple, raising on any error."""
        if not isinstance(result, tuple):
            result = (result,)
        status, values = result[0], result[1:]
        if status != self._cu.CUresult.CUDA_SUCCESS:
            _, name = self._cu.cuGetErrorName(status)
            name = name.decode() if isinstance(name, bytes) else str(name)
            raise DriverCallError(f"{call} failed with {name} ({int(status)})")
        return values[0] if len(values) == 1 else (values or None)

    def _with_context(self):
        import torch
        return torch.cuda.device(self._index)

    @property
    def granularity_bytes(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        return f"cuda:{self._index}"

    def reserve(self, size_bytes: int) -> int:
        self.check_page_bytes(size_bytes)
        with self._with_context():
            address = self._check("cuMemAddressReserve",
                                  self._cu.cuMemAddressReserve(size_bytes, self._granularity, 0, 0))
        return int(address)

    def free_reservation(self, address: int, size_bytes: int) -> None:
        with self._with_context():
            self._check("cuMemAddressFree", self._cu.cuMemAddressFree(address, size_bytes))

    def create_pages(self, num_pages: int, page_bytes: int) -> Sequence[Any]:
        self.check_page_bytes(page_bytes)
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

    def release_pages(self, handles: Sequence[Any]) -> None:
        with self._with_context():
            for handle in handles:
                self._check("cuMemRelease", self._cu.cuMemRelease(handle))

    def map(self, address: int, handle: Any, page_bytes: int) -> None:
        with self._with_context():
            self._check("cuMemMap", self._cu.cuMemMap(address, page_bytes, 0, handle, 0))
            try:
                self._check("cuMemSetAccess",
                            self._cu.cuMemSetAccess(address, page_bytes, [self._access], 1))
            except DriverCallError:
                self._cu.cuMemUnmap(address, page_bytes)  # never leave a mapping half done
                raise

    def unmap(self, address: int, page_bytes: int) -> None:
        with self._with_context():
            self._check("cuMemUnmap", self._cu.cuMemUnmap(address, page_bytes))

    def tensor(self, address: int, num_bytes: int):
        import torch
        if num_bytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.as_tensor(_CudaArrayView(address, num_bytes), device=self.device)
