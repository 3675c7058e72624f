"""Zero-copy torch tensors over raw addresses, through a DLPack capsule that names the device.

Both drivers build their tensors here, so the CPU tests run the exact code the GPU uses; only
the DLPack device type differs (kDLCPU or kDLCUDA).

Why DLPack and not ``__cuda_array_interface__``: torch turns a CUDA array interface into a
tensor by asking ``cudaPointerGetAttributes`` which device the pointer lives on (unless the
installed torch honours an explicit device index there, which older releases do not). A cache
makes its tensors over a reservation before any page is mapped, and an unmapped reserved address
belongs to no device, so that query fails. ``at::fromDLPack`` takes the device from the capsule
and never asks.

Ownership: each capsule's ``DLManagedTensor`` (with its shape) is one block from libc
``malloc``; its deleter is libc ``free``, which torch calls when the last tensor sharing the
storage dies: no Python runs then. ``on_release`` is called once at that moment through a
``weakref.finalize`` on the tensor's storage, not from the deleter: torch keeps a storage's
Python object for as long as any tensor shares the storage (PyObject preservation, torch
>= 2.1; a release that came early would show as ``live_views`` 0 under a view), and
CPython runs weakref callbacks with a pending exception saved and restored, so the last view
may die while an exception propagates (a frame unwinding drops it) and the exception arrives
intact. A deleter that ran Python instead (a ctypes callback) failed in that state: the user's
exception became a SystemError, the release never ran, and the interpreter could crash
(tests/vmem/test_dlpack_exception.py). The callback runs with the GIL, on whichever thread
dropped the last reference; that is how a ``VirtualRange`` learns its last view is gone, so a
range closed under a live view keeps the view's memory readable until then (vmem/vrange.py),
as a torch storage keeps its own memory. It is not called at interpreter exit, and must not
raise (CPython would report it as an ignored exception).
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Callable, Optional

from .checks import as_int
from .errors import VMemConfigError

__all__ = ["DLPACK_CPU", "DLPACK_CUDA", "tensor_at"]

DLPACK_CPU, DLPACK_CUDA = 1, 2          # DLDeviceType values: kDLCPU, kDLCUDA
_DLPACK_UINT = 1                        # DLDataTypeCode kDLUInt


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_BLOCK_BYTES = ctypes.sizeof(_DLManagedTensor) + ctypes.sizeof(ctypes.c_int64)
_libc = ctypes.CDLL(None)               # the process's own malloc/free, the ones torch links
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]
_FREE_ADDRESS = ctypes.cast(_libc.free, ctypes.c_void_p).value
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def managed_block_bytes() -> int:
    """Bytes of libc memory each tensor_at call lends torch until the tensor dies."""
    return _BLOCK_BYTES


def tensor_at(address: int, num_bytes: int, device_type: int, device_id: int = 0,
              on_release: Optional[Callable[[], None]] = None):
    """A 1-D uint8 tensor over ``num_bytes`` at ``address`` on the given DLPack device.

    The caller guarantees the bytes stay valid while the tensor lives (``on_release()`` is
    called once when the last tensor sharing its storage dies; never when this raises); mapping
    state may change underneath it (the tensor only holds an address).
    """
    import torch.utils.dlpack
    address = as_int(address, "a tensor's address")    # None made a tensor at NULL
    if address <= 0:
        raise VMemConfigError(f"a tensor's address must be a mapped address (> 0), got "
                              f"{address:#x}")
    if num_bytes <= 0:
        raise ValueError(f"tensor_at needs a positive byte count, got {num_bytes}")
    block = _libc.malloc(_BLOCK_BYTES)
    if not block:
        raise MemoryError(f"malloc of {_BLOCK_BYTES} bytes for a DLPack capsule failed")
    try:
        managed = _DLManagedTensor.from_address(block)
        shape = (ctypes.c_int64 * 1).from_address(block + ctypes.sizeof(_DLManagedTensor))
        shape[0] = num_bytes
        managed.dl_tensor.data = address
        managed.dl_tensor.device = _DLDevice(device_type, device_id)
        managed.dl_tensor.ndim = 1
        managed.dl_tensor.dtype = _DLDataType(_DLPACK_UINT, 8, 1)
        managed.dl_tensor.shape = ctypes.cast(ctypes.addressof(shape), ctypes.POINTER(ctypes.c_int64))
        managed.dl_tensor.strides = None   # compact row-major
        managed.dl_tensor.byte_offset = 0
        managed.manager_ctx = None
        managed.deleter = _FREE_ADDRESS
        capsule = _capsule_new(block, b"dltensor", None)
    except BaseException:
        _libc.free(block)
        raise
    try:
        tensor = torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        if _capsule_unconsumed(capsule):  # torch renames the capsule once it owns the block
            _libc.free(block)
        raise
    if on_release is not None:
        release = weakref.finalize(tensor.untyped_storage(), on_release)
        release.atexit = False           # a view alive at exit is not released
    return tensor


_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _capsule_unconsumed(capsule) -> bool:
    return bool(_capsule_is_valid(capsule, b"dltensor"))
