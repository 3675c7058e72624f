"""vmemkv.vmem.dlpack: zero-copy tensors over raw addresses, and the capsule memory they borrow.

The accounting tests read glibc's ``mallinfo2`` (bytes in use by malloc): a capsule block that
torch never frees, or one freed twice, shows up there (or crashes the process).
"""
import ctypes
import gc

import pytest
import torch

from vmemkv.vmem.dlpack import DLPACK_CPU, DLPACK_CUDA, managed_block_bytes, tensor_at


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
if not hasattr(_libc, "mallinfo2"):
    pytest.skip("glibc >= 2.33 (mallinfo2) is needed to count malloc'd bytes",
                allow_module_level=True)
_libc.mallinfo2.restype = _MallInfo2


def malloc_bytes_in_use() -> int:
    gc.collect()
    return _libc.mallinfo2().uordblks


@pytest.fixture
def buffer():
    raw = (ctypes.c_char * 4096)()
    return raw, ctypes.addressof(raw)


def test_tensor_is_a_zero_copy_view_both_ways(buffer):
    raw, address = buffer
    view = tensor_at(address, 4096, DLPACK_CPU)
    assert view.dtype == torch.uint8 and view.shape == (4096,) and view.data_ptr() == address
    view[:5] = torch.tensor(list(b"hello"), dtype=torch.uint8)
    assert raw[:5] == b"hello"
    raw[100] = b"Z"
    assert view[100].item() == ord("Z")


def test_capsule_block_is_freed_when_the_last_tensor_dies(buffer):
    _, address = buffer
    count = 5_000
    for _ in range(50):      # warm malloc's caches so the baseline is stable
        tensor_at(address, 4096, DLPACK_CPU)
    baseline = malloc_bytes_in_use()
    tensors = [tensor_at(address, 4096, DLPACK_CPU) for _ in range(count)]
    views = [t[10:20] for t in tensors[:100]]   # views share the storage, and keep it alive
    alive = malloc_bytes_in_use() - baseline
    assert alive >= count * managed_block_bytes()
    del tensors
    assert malloc_bytes_in_use() - baseline >= 100 * managed_block_bytes()
    del views
    # leaking the blocks would leave count * 72 bytes (360 kB) in use
    assert malloc_bytes_in_use() - baseline < count * managed_block_bytes() // 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot make CUDA tensors")
def test_a_capsule_torch_refuses_is_not_leaked(buffer):
    _, address = buffer
    with pytest.raises((AssertionError, RuntimeError)):
        tensor_at(address, 4096, DLPACK_CUDA)
    baseline = malloc_bytes_in_use()
    for _ in range(2_000):
        with pytest.raises((AssertionError, RuntimeError)):
            tensor_at(address, 4096, DLPACK_CUDA)
    assert malloc_bytes_in_use() - baseline < 2_000 * managed_block_bytes() // 10


@pytest.mark.parametrize("num_bytes", [0, -4096])
def test_non_positive_sizes_are_refused(buffer, num_bytes):
    with pytest.raises(ValueError, match=str(num_bytes)):
        tensor_at(buffer[1], num_bytes, DLPACK_CPU)
