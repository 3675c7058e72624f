"""The machine's limits that attention rows are measured against: read and copy bandwidth, and
fp32 matmul FLOP/s.

    python -m vmemkv.benchmarks.yardstick [--device cpu] [--threads N] [--mib 256] [--json f.json]

* **read bandwidth** (the decode yardstick: decode attention only reads K/V): a large
  same-device reduction, STREAM's read kernel, every byte read once and nothing written, over
  torch's threads. Measured three ways on the CPU: torch's ``sum``, numpy's ``sum`` (pairwise,
  reported only) and a native loop (``yardstick.c``, OpenMP, built like the attention kernel);
  the yardstick is the faster of torch's and the native loop. Both must return the exact count
  of the ones placed in the array (one every 61 floats), so neither can have skipped a load.
* **copy bandwidth**: ``dst.copy_(src)``, bytes read + bytes written per second (the figure the
  attention rows used to be divided by).
* **matmul FLOP/s** (the prefill yardstick: prefill is compute-bound): ``torch.mm`` of two
  ``n x n`` matrices in the attention dtype (fp32 on the CPU), ``2 n^3`` flops.
* **FMA peak** (CPU): the native loop's 12 independent vector FMAs per round on every thread,
  no memory touched: the arithmetic roof nothing fp32 can pass. torch's matmul may sit well
  below it (its BLAS may not use the CPU's widest vectors), and a kernel may then beat it.

Every figure is the median of ``repeats`` calls after a warm-up. ``measure()`` is what
``benchmarks/attention.py`` runs first (its rows report their share of the right one) and what
``vmemkv bench`` shows in its summary.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Callable

import torch

from vmemkv.benchmarks.alloc import refuse_missing_cuda
from vmemkv.benchmarks.common import exit_status, median_seconds
from vmemkv.cli import OneLineArgumentParser
from vmemkv.runtime.errors import CacheTooLargeError
from vmemkv.runtime.memory import check_fits_device
from vmemkv.scheduler.cliargs import POSITIVE_INT, thread_count, result_file
from vmemkv.scheduler import result_files

NATIVE = Path(__file__).with_name("yardstick.c")
NATIVE_HEADERS = (Path(__file__).parent.parent / "runtime" / "attention" / "cpu_varlen_math.h",)
FMA_ROUNDS = 5_000_000    # ~20 ms a call at ~100 GFLOP/s per thread
ONE_EVERY = 61            # a 1.0 every 61 floats: a reader that skips any 61 in a row misses one
CPU_BYTES = 256 << 20     # 8x the 32 MiB L3 of the development machine
CUDA_BYTES = 1 << 30


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _timed(fn, device, repeats: int) -> float:
    return median_seconds(fn, warmup=2, repeats=repeats, sync=_sync(device))


def _native(name: str, argtypes: list):
    from vmemkv.runtime.attention import native
    fn = getattr(native.library(NATIVE, NATIVE_HEADERS), name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_double
    return fn


def native_read_sum():
    """``vk_read_sum(ptr, n, threads) -> double`` from yardstick.c, built on first use."""
    return _native("vk_read_sum", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])


def fma_peak(rounds: int = FMA_ROUNDS, repeats: int = 5) -> float:
    """FLOP/s of yardstick.c's FMA loop on torch's threads (12 x VW lanes x 2 flops a round)."""
    fn, threads = _native("vk_fma_peak", [ctypes.c_int64, ctypes.c_int]), torch.get_num_threads()
    lanes = _native("vk_vector_lanes", [])
    lanes.restype = ctypes.c_int
    t = _timed(lambda: fn(rounds, threads), torch.device("cpu"), repeats)
    return threads * rounds * 12 * lanes() * 2 / t


def read_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> dict:
    """Bytes/s of reading ``nbytes`` once: torch's sum, numpy's and the native loop (CPU), each
    checked to have read every float (the exact count of ones comes back)."""
    x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    x[::ONE_EVERY] = 1.0
    want, threads = float(x[::ONE_EVERY].numel()), torch.get_num_threads()
    readers = {"torch": lambda: x.sum().item()}
    if device.type == "cpu":
        array, loop = x.numpy(), native_read_sum()
        readers["numpy"] = lambda: float(array.sum())
        readers["native"] = lambda: loop(x.data_ptr(), x.numel(), threads)
    out = {}
    for name, read in readers.items():
        got = read()
        if got != want:
            raise AssertionError(f"the {name} read sum is {got}, not {want}: it skipped data")
        out[f"read_{name}_gb_per_s"] = x.numel() * 4 / _timed(read, device, repeats) / 1e9
    out["read_gb_per_s"] = max(out.get("read_native_gb_per_s", 0.0), out["read_torch_gb_per_s"])
    return out


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a large same-device copy, counting the read and the write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, repeats)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """FLOP/s of ``torch.mm`` on two ``n x n`` matrices: 2 n^3 flops per call."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    return 2 * n ** 3 / _timed(lambda: torch.mm(a, b, out=out), device, repeats)


def measure(device="cpu", dtype: torch.dtype = torch.float32, nbytes: int | None = None,
            matmul_n: int | None = None, repeats: int = 5, fma_rounds: int = FMA_ROUNDS) -> dict:
    """Every yardstick on ``device`` at torch's current thread count (GB/s, GFLOP/s)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or (CUDA_BYTES if cuda else CPU_BYTES)
    matmul_n = matmul_n or (8192 if cuda else 1024)
    # the copy holds two arrays of nbytes at once, the matmul three n x n
    check_fits_device(f"the yardsticks ({nbytes} bytes read and copied)",
                      2 * nbytes + 3 * matmul_n ** 2 * max(dtype.itemsize, 4), device,
                      remedy="lower --mib")
    out = {"device": str(device), "threads": torch.get_num_threads(), "nbytes": nbytes}
    out.update(read_bandwidth(device, nbytes, repeats))
    out["copy_gb_per_s"] = copy_bandwidth(device, nbytes, repeats) / 1e9
    out["matmul_gflop_per_s"] = matmul_flops(device, dtype, matmul_n, repeats) / 1e9
    out.update(matmul_n=matmul_n, matmul_dtype=str(dtype).replace("torch.", ""))
    if not cuda:
        out["fma_peak_gflop_per_s"] = fma_peak(fma_rounds, repeats) / 1e9
    return out


def describe(y: dict) -> str:
    """One line: read (torch / native), copy, matmul."""
    native = f", native loop {y['read_native_gb_per_s']:.1f}" if "read_native_gb_per_s" in y else ""
    numpy = f", numpy {y['read_numpy_gb_per_s']:.1f}" if "read_numpy_gb_per_s" in y else ""
    peak = f", FMA peak {y['fma_peak_gflop_per_s']:.1f}" if "fma_peak_gflop_per_s" in y else ""
    return (f"# yardsticks ({y['threads']} threads): read {y['read_gb_per_s']:.1f} GB/s (torch sum "
            f"{y['read_torch_gb_per_s']:.1f}{native}{numpy}), copy {y['copy_gb_per_s']:.1f} GB/s "
            f"(read + write), matmul {y['matmul_gflop_per_s']:.1f} GFLOP/s "
            f"({y['matmul_dtype']}, n={y['matmul_n']}){peak}")


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cpu", "cuda"), help="cpu or cuda (default: cuda when present)")
    p.add_argument("--threads", type=thread_count, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--mib", type=POSITIVE_INT, help="MiB read and copied (default: 256 CPU, 1024 CUDA)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=5)
    p.add_argument("--json", type=result_file, help="write the figures as JSON here (whole)")
    args = p.parse_args(argv)
    refuse_missing_cuda(p, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    try:
        y = measure(args.device, dtype, args.mib and args.mib << 20, repeats=args.repeats)
    except CacheTooLargeError as error:
        p.error(str(error))
    print(describe(y))
    if args.json:
        result_files.write_json(args.json, y, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status("yardstick", main))
