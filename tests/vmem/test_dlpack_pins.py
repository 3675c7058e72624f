"""Pins on vmem/dlpack.py's ownership rule: a capsule torch never took is freed by tensor_at
itself, at once, and its on_release is never called (the caller still holds the bytes)."""
import ctypes

import pytest
import torch

from vmemkv.vmem import dlpack
from vmemkv.vmem.dlpack import DLPACK_CPU, tensor_at


class _CountingLibc:
    """The process's malloc and free, recording each block handed out and each freed."""

    def __init__(self, real) -> None:
        self.real, self.malloced, self.freed = real, [], []

    def malloc(self, size):
        block = self.real.malloc(size)
        self.malloced.append(block)
        return block

    def free(self, block):
        self.freed.append(block)
        self.real.free(block)


def test_a_capsule_torch_refuses_before_taking_it_is_freed_at_once(monkeypatch):
    raw = (ctypes.c_char * 4096)()
    libc = _CountingLibc(dlpack._libc)
    monkeypatch.setattr(dlpack, "_libc", libc)

    def refuse(capsule):        # a torch that checks the capsule before consuming it
        raise RuntimeError("unsupported device")

    monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", refuse)
    released = []
    with pytest.raises(RuntimeError, match="unsupported device"):
        tensor_at(ctypes.addressof(raw), 4096, DLPACK_CPU, on_release=lambda: released.append(1))
    assert len(libc.malloced) == 1 and libc.freed == libc.malloced    # freed once, by tensor_at
    assert released == []                  # the caller still holds the bytes: no release

