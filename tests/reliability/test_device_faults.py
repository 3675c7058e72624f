"""The same rollback guarantees on each real driver: host here, CUDA where a GPU is present.

A map fault at every call index of a plan leaves mappings, manager and an existing sequence's
contents unchanged, and the retry succeeds; a REAL out-of-memory while building the pool (CUDA:
cuMemCreate fails once the GPU is nearly full) leaves the device's free memory where it was.
"""
import gc

import pytest
import torch

from vmemkv.runtime.kv import make_kv
from tests.runtime.run_plan import run_plan
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.vmem import DriverCallError, open_driver
from vmemkv.vmem.faults import FaultInjectingDriver

from .model import canon

DEVICES = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


def build(kind: str):
    driver = FaultInjectingDriver(open_driver(kind))
    if kind == "cuda":   # 2 MiB pages: per-layer 8 heads * 128 * fp16 = 2 KiB/token -> 1024 tokens
        config = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float16,
                             device="cuda", max_batch=4, max_context=2048)
        page_bytes, length = 2 * 2**20, 1500
    else:                # 4 KiB pages: 2 heads * 16 * fp32 = 128 B/token -> 32 tokens
        config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=4, max_context=64)
        page_bytes, length = 4096, 47
    cache = make_kv(config, "vmem", page_bytes=page_bytes, driver=driver,
                       cache_bytes=3 * config.max_context * config.bytes_per_token)
    return cache, driver, config, length


def state(cache, driver):
    mgr = cache.manager
    return (canon({k: v for k, v in vars(mgr).items() if k != "model"}),
            cache.range.mapped_pages(), driver.mapped_addresses)


@pytest.mark.parametrize("kind", DEVICES)
def test_map_fault_at_every_index_on_a_real_driver(kind):
    cache, driver, config, length = build(kind)
    mgr = cache.manager
    run_plan(mgr, cache, lambda: mgr.allocate(0, length))
    cache.begin_step([(0, 0, length)])
    gen = torch.Generator().manual_seed(0)
    shape = (length, config.num_kv_heads, config.head_dim)
    truth = [(torch.randn(shape, generator=gen).to(config.dtype),
              torch.randn(shape, generator=gen).to(config.dtype)) for _ in range(config.num_layers)]
    for layer, (k, v) in enumerate(truth):
        cache.write(layer, k.to(config.torch_device), v.to(config.torch_device))
    before = state(cache, driver)
    failures = 0
    while True:
        driver.fail_at("map", failures)
        try:
            run_plan(mgr, cache, lambda: (mgr.allocate(1, length), mgr.fork(0, 2), mgr.append(2, 1)))
        except PlanExecutionError as error:
            assert error.rolled_back and isinstance(error.__cause__, DriverCallError)
            assert state(cache, driver) == before
            cache.check_integrity()
            for layer, (k, v) in enumerate(truth):
                got_k, got_v = cache.read(0, layer, length)
                assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)
            failures += 1
            continue
        finally:
            driver.disarm()
        break
    assert failures >= 4
    cache.check_integrity()
    for layer, (k, v) in enumerate(truth):    # the fork's copy-on-write copied the right bytes
        got_k, _ = cache.read(2, layer, length)
        assert torch.equal(got_k.cpu(), k)
    cache.close()


def settled_free_bytes() -> int:
    """The device's free bytes with torch's caching allocator settled: warmed up (the driver's
    own ``torch.empty(1)`` would otherwise take a fresh 2 MiB small-pool segment after the first
    reading) and its unused cached segments released, so only live memory is counted."""
    torch.empty(1, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
def test_real_cuda_out_of_memory_at_pool_build_leaves_nothing_allocated():
    config = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float16,
                         device="cuda", max_batch=4, max_context=2048)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - 1 * 2**30, dtype=torch.uint8, device="cuda")  # ~1 GiB left
    try:
        free_before = settled_free_bytes()
        with pytest.raises(DriverCallError):           # cuMemCreate runs out part-way
            make_kv(config, "vmem", page_bytes=2 * 2**20, cache_bytes=4 * 2**30)
        assert settled_free_bytes() == free_before
    finally:
        del filler
        torch.cuda.empty_cache()
