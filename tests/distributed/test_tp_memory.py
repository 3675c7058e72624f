"""Each rank checks its own cache against its own device's memory, in its own process: rank 0
reads no other rank's GPU (that opened a CUDA context, hundreds of MiB, on each), and a rank
whose device lacks memory refuses the engine with CacheTooLargeError naming that rank, its
device, the bytes asked and the limit, with no process left. CPU tests starve one rank through
worker.FREE_BYTES_HOOK; the GPU tests (marked) check the CUDA specifics."""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime import memory
from vmemkv.runtime.distributed import worker
from vmemkv.runtime.engine import Engine, tensor_parallel
from vmemkv.runtime.errors import CacheTooLargeError

from ..engine.conftest import model

CACHE_BYTES = 65536


def test_rank_0_reads_no_other_gpus_memory_before_the_cuda_ranks_start(monkeypatch):
    read = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda d: read.append(str(d)) or 2**40)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda d: read.append(str(d)) or 2**40)
    cfg = SimpleNamespace(tensor_parallel_size=4, tp_launch="spawn", tp_devices=None,
                          swap_bytes=0)
    tensor_parallel.check_ranks_fit(cfg, 2**20, torch.device("cuda", 0))
    assert read == []     # before: cuda:0..cuda:3, a CUDA context on each in rank 0's process
    cfg.swap_bytes = 2**20         # the ranks' swap spaces: host memory, read as the host's
    tensor_parallel.check_ranks_fit(cfg, 2**20, torch.device("cuda", 0))
    assert read and set(read) == {"cpu"}


def test_a_rank_checks_its_cache_against_its_devices_memory_naming_rank_device_and_bytes(
        monkeypatch):
    monkeypatch.setenv(worker.FREE_BYTES_HOOK, "0:999999999999,3:4096")
    worker.check_rank_memory(0, CACHE_BYTES, torch.device("cpu"))
    worker.check_rank_memory(3, 4096, torch.device("cpu"))                 # exactly fits
    with pytest.raises(CacheTooLargeError, match=f"tensor-parallel rank 3's KV cache on cpu needs "
                                                 f"{CACHE_BYTES} bytes .* host MemAvailable is "
                                                 f"4096 bytes"):
        worker.check_rank_memory(3, CACHE_BYTES, torch.device("cpu"))


def test_a_spawned_rank_short_of_memory_refuses_the_engine_with_its_memory_error_and_no_process(
        monkeypatch):
    # rank 0's checks pass (host memory is plenty); rank 1, in its own process, reads 4096
    # bytes available (the hook) when it checks before building its cache
    monkeypatch.setenv(worker.FREE_BYTES_HOOK, "1:4096")
    with pytest.raises(CacheTooLargeError, match=f"tensor-parallel rank 1's KV cache on cpu needs "
                                                 f"{CACHE_BYTES} bytes .* host MemAvailable is "
                                                 f"4096 bytes"):
        Engine(model(), max_batch=2, max_context=64, cache="paged", cache_bytes=CACHE_BYTES,
               tensor_parallel_size=2, self_check=False)
    assert not multiprocessing.active_children()


@pytest.mark.gpu
def test_a_cuda_rank_short_of_memory_refuses_the_engine_naming_its_gpu(monkeypatch):
    # one GPU: two ranks share cuda:0 (activations over gloo), rank 1 reads 4096 bytes free
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from .test_tensor_parallel_cuda import SharedGpu
    monkeypatch.setattr(tensor_parallel, "placement_of",
                        lambda cfg, device: SharedGpu(("cuda:0",) * cfg.tensor_parallel_size))
    monkeypatch.setenv(worker.FREE_BYTES_HOOK, "1:4096")
    from vmemkv.runtime.models import build_model
    with pytest.raises(CacheTooLargeError, match=f"rank 1's KV cache on cuda:0 needs {2**21} "
                                                 f"bytes .* cuda:0 free memory is 4096 bytes"):
        Engine(build_model("tiny-llama", seed=0, device="cuda"), max_batch=2, max_context=64,
               cache_bytes=2**21, tensor_parallel_size=2, self_check=False)
    assert not multiprocessing.active_children()


NO_CONTEXT = """
import torch
from vmemkv.runtime.engine import Engine
from vmemkv.runtime.models import build_model
if __name__ == "__main__":
    with Engine(build_model("tiny-llama", seed=0, device="cuda:0"), max_batch=2, max_context=64,
                tensor_parallel_size=2, self_check=False) as engine:
        print("contexts", [torch._C._cuda_hasPrimaryContext(i) for i in range(2)])
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_rank_0s_process_opens_no_cuda_context_on_rank_1s_gpu(tmp_path):
    # a fresh process: this one may hold contexts from other tests
    script = tmp_path / "no_context.py"
    script.write_text(NO_CONTEXT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "contexts [True, False]" in out.stdout
