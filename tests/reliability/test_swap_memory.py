"""The swap space (``swap_bytes``) is host memory that swapped-out sequences fill on demand
(pinned on CUDA): it is checked against the host's total and available memory before anything
is built, beside the KV cache when that is on the host too, once per tensor-parallel rank that
holds one on this machine. ``swap_bytes=100 GiB`` on this 23.5 GiB host was accepted, and an
engine swapping out enough sequences would have pushed the machine into the OOM killer."""
import multiprocessing

import pytest
import torch

from vmemkv.cli import main
from vmemkv.runtime import memory
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import CacheTooLargeError
from vmemkv.runtime.kv import make_kv

from ..vmem_only_options import options_for
from .conftest import assert_words, mem_total


def test_a_swap_space_larger_than_the_host_is_refused_before_any_page(model):
    from vmemkv.vmem.faults import FaultInjectingDriver
    from vmemkv.vmem.host import HostDriver
    driver = FaultInjectingDriver(HostDriver())
    swap_bytes = 2 * mem_total()
    with pytest.raises(CacheTooLargeError) as info:
        Engine(model, cache_bytes=1 << 20, preemption="swap", swap_bytes=swap_bytes, driver=driver)
    assert isinstance(info.value, MemoryError)
    assert_words(info.value, [f"swap_bytes={swap_bytes}", f"{swap_bytes + (1 << 20)} bytes",
                              "MemTotal", str(mem_total()), "lower swap_bytes"])
    assert driver.calls["create_pages"] == 0 and driver.calls["reserve"] == 0


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_swap_and_cache_together_above_available_memory_are_refused(model, monkeypatch, cache):
    # 140,000 bytes available: the 64 KiB cache fits beside a 64 KiB swap space, not a 128 KiB one
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 140_000)
    kwargs = dict(cache=cache, max_batch=4, max_context=64, block_size=8, cache_bytes=65536,
                  preemption="swap", max_tokens_per_step=4,   # small logits
                  **options_for(cache, page_bytes=4096))
    with pytest.raises(CacheTooLargeError) as info:
        Engine(model, swap_bytes=131072, **kwargs)
    assert_words(info.value, ["swap_bytes=131072", "beside the KV cache (65536 bytes)",
                              "196608 bytes", "MemAvailable", "140000 bytes"])
    with Engine(model, swap_bytes=65536, **kwargs) as engine:   # it fits, and it swaps
        out = engine.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in out] == [40] * 4
        assert engine.stats().num_swap_preemptions > 0


def test_a_cache_on_a_gpu_is_not_counted_in_host_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 40_000)
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 80_000)
    gpu = torch.device("cuda")
    memory.check_swap_fits(32768, gpu, cache_bytes=10**12)     # the GPU's cache: not host memory
    memory.check_swap_fits(0, "cpu", cache_bytes=10**12)       # no swap space: nothing to check
    with pytest.raises(CacheTooLargeError, match=r"the swap space \(swap_bytes=50000\) needs "
                                                 r"50000 bytes .* host MemAvailable"):
        memory.check_swap_fits(50_000, gpu, cache_bytes=10**12)
    with pytest.raises(CacheTooLargeError, match="3 tensor-parallel ranks' swap spaces "
                                                 r"\(swap_bytes=20000 each\) needs 60000 bytes"):
        memory.check_swap_fits(20_000, gpu, copies=3)


def test_make_kv_checks_the_swap_space_after_validating_it(monkeypatch):
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2, max_context=32)
    from vmemkv.scheduler.errors import ConfigError
    with pytest.raises(ConfigError, match="swap_bytes"):
        make_kv(config, "paged", swap_bytes="lots")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 40_000)
    with pytest.raises(CacheTooLargeError, match="swap_bytes=40000"):
        make_kv(config, "paged", cache_bytes=16384, swap_bytes=40_000)


def test_tensor_parallel_ranks_swap_spaces_together_are_refused_before_starting(model, monkeypatch):
    # 3 MiB available: one rank's 1 MiB cache and 512 KiB swap fit, two ranks' (3 MiB) do not
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 3 * 2**20 - 1)
    before = multiprocessing.active_children()
    with pytest.raises(CacheTooLargeError, match="2 tensor-parallel ranks' swap spaces"):
        Engine(model, max_batch=2, max_context=128, tensor_parallel_size=2, self_check=False,
               cache_bytes=2**20, preemption="swap", swap_bytes=2**19, max_tokens_per_step=2)
    assert multiprocessing.active_children() == before


def test_generate_cli_refuses_a_swap_space_far_above_the_host(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("1 2 3\n")
    code = main(["generate", "--prompts", str(prompts), "--preemption", "swap",
                 "--swap-bytes", "100000000000000"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert_words(err, ["CacheTooLargeError", "--swap-bytes 100000000000000", "MemTotal"])
