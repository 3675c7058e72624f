"""vmemkv.vmem.dlpack: zero-copy tensors over raw addresses, and the capsule memory they borrow.

The accounting tests read glibc's ``mallinfo2`` (bytes in use by malloc): a capsule block that
torch never frees, or one freed twice, shows up there (or crashes the process).
"""
import ctypes
import json
import subprocess
import sys

import pytest
import torch

from vmemkv.vmem.dlpack import DLPACK_CPU, tensor_at


if not hasattr(ctypes.CDLL(None), "mallinfo2"):
    pytest.skip("glibc >= 2.33 (mallinfo2) is needed to count malloc'd bytes",
                allow_module_level=True)


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


# The two accounting tests measure in a process of their own: malloc's counters are the whole
# process's, and in a test worker other tests' leftovers (threads, finalizers) free memory
# between two readings (seen once in CI: -596,752 bytes "alive" after 5,000 capsules).
ISOLATED = """
import ctypes, gc, json, sys
from vmemkv.vmem.dlpack import DLPACK_CPU, DLPACK_CUDA, managed_block_bytes, tensor_at

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def in_use():
    gc.collect()
    return libc.mallinfo2().uordblks

raw = (ctypes.c_char * 4096)()
address = ctypes.addressof(raw)
out = {"block": managed_block_bytes()}
if sys.argv[1] == "freed":
    for _ in range(50):      # warm malloc's caches so the baseline is stable
        tensor_at(address, 4096, DLPACK_CPU)
    base = in_use()
    tensors = [tensor_at(address, 4096, DLPACK_CPU) for _ in range(5000)]
    views = [t[10:20] for t in tensors[:100]]   # views share the storage, and keep it alive
    out["alive"] = in_use() - base
    del tensors
    out["views_alive"] = in_use() - base
    del views
    out["after"] = in_use() - base
else:
    def refused():
        try:
            tensor_at(address, 4096, DLPACK_CUDA)
        except (AssertionError, RuntimeError):
            return True
        return False
    out["refused"] = refused()
    base = in_use()
    out["all_refused"] = all(refused() for _ in range(2000))
    out["after"] = in_use() - base
print(json.dumps(out))
"""


def isolated(case: str) -> dict:
    """The accounting script's figures for ``case``, from a fresh interpreter."""
    run = subprocess.run([sys.executable, "-c", ISOLATED, case], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_capsule_block_is_freed_when_the_last_tensor_dies():
    got, count = isolated("freed"), 5_000
    assert got["alive"] >= count * got["block"]
    assert got["views_alive"] >= 100 * got["block"]
    # leaking the blocks would leave count * 72 bytes (360 kB) in use
    assert got["after"] < count * got["block"] // 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot make CUDA tensors")
def test_a_capsule_torch_refuses_is_not_leaked():
    got = isolated("refused")
    assert got["refused"] and got["all_refused"]
    assert got["after"] < 2_000 * got["block"] // 10


@pytest.mark.parametrize("num_bytes", [0, -4096])
def test_non_positive_sizes_are_refused(buffer, num_bytes):
    with pytest.raises(ValueError, match=str(num_bytes)):
        tensor_at(buffer[1], num_bytes, DLPACK_CPU)
