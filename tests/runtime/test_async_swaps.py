"""Issue 17 item 6: swaps to and from pinned host memory are queued, not waited for.

On CUDA every swap copy is ``non_blocking`` (ordered on the current stream, so a swap-in after
a swap-out reads finished bytes) and only a host read of a swap buffer waits. On the CPU the
copies are plain; a cache that reports ``swaps_are_async`` (as a CUDA one does) shows which
copies are queued and when the host waits. The GPU test queues a long kernel first, so a copy
that was not ordered behind it would read or write stale bytes.
"""
import pytest
import torch

from vmemkv.runtime.cache.paged_cache import PagedKVCache
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.kv import make_kv
from tests.runtime.run_plan import run_plan


def paged(device="cpu"):
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, max_batch=4, max_context=32,
                         device=device)
    return make_kv(config, "paged", block_size=4, swap_bytes=2**20), config


def fill(kv, config, seq_id, length, seed):
    run_plan(kv.manager, kv, lambda: kv.manager.allocate(seq_id, length))
    kv.begin_step([(seq_id, 0, length)])
    gen = torch.Generator().manual_seed(seed)
    truth = []
    for layer in range(config.num_layers):
        k, v = (torch.randn(length, config.num_kv_heads, config.head_dim, generator=gen)
                for _ in range(2))
        kv.write(layer, k.to(config.torch_device), v.to(config.torch_device))
        truth.append((k, v))
    return truth


def test_cuda_style_swaps_queue_every_copy_and_wait_only_to_read(monkeypatch):
    kv, config = paged()
    truth = fill(kv, config, 0, 13, seed=1)
    monkeypatch.setattr(PagedKVCache, "swaps_are_async", property(lambda self: True))
    waits, flags = [], []
    monkeypatch.setattr(PagedKVCache, "_wait_for_swaps", lambda self: waits.append(1))
    copy, to = torch.Tensor.copy_, torch.Tensor.to

    def recording_copy(self, src, non_blocking=False):
        flags.append(non_blocking)
        return copy(self, src, non_blocking=non_blocking)

    def recording_to(self, *args, **kwargs):
        flags.append(kwargs.get("non_blocking", False))
        return to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    run_plan(kv.manager, kv, lambda: kv.manager.swap_out(0))
    assert flags == [True] and not waits            # queued, the host did not wait
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    buffer = kv.cache.swap_buffer(0)
    assert waits == [1]                             # a host read waits for the copies
    for layer, (k, v) in enumerate(truth):
        assert torch.equal(buffer[layer, 0], k) and torch.equal(buffer[layer, 1], v)
    run_plan(kv.manager, kv, lambda: kv.manager.swap_in(0))
    assert flags[-1] is True                        # the swap-in's host-to-device copy too
    monkeypatch.undo()
    for layer, (k, v) in enumerate(truth):
        got_k, got_v = kv.read(0, layer, 13)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_cpu_cache_copies_synchronously():
    kv, _ = paged()
    assert kv.cache.swaps_are_async is False


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["paged", "vmem"])
def test_swaps_behind_a_long_kernel_stay_ordered_on_cuda(kind):
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                         device="cuda", max_batch=4, max_context=8192)  # one 2 MiB page per slot
    kv = make_kv(config, kind, swap_bytes=2**24, **({"block_size": 16} if kind == "paged" else {}))
    truth = fill(kv, config, 0, 200, seed=2)
    assert kv.cache.swaps_are_async
    torch.cuda._sleep(100_000_000)                  # the swap-out is queued behind this
    run_plan(kv.manager, kv, lambda: kv.manager.swap_out(0))
    run_plan(kv.manager, kv, lambda: kv.manager.swap_in(0))
    for layer, (k, v) in enumerate(truth):
        got_k, got_v = kv.read(0, layer, 200)
        assert torch.equal(got_k.cpu(), k.to(config.dtype)) and torch.equal(got_v.cpu(), v.to(config.dtype))
    kv.cache.close()
