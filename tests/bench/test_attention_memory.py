"""benchmarks/attention.py checks every configuration's memory before it measures anything: a
BATCHxCTX the device cannot hold is one line on stderr and exit 2, before the yardsticks run
and before a tensor is allocated (``--configs 2048x32768`` needs about 2 TiB; its K/V were filled
until the allocator or the OOM killer stopped it)."""
import pytest
import torch

from vmemkv.benchmarks import attention
from vmemkv.benchmarks.attention_caches import PROCESS_BYTES, bytes_needed


def test_a_configuration_the_host_cannot_hold_is_refused_before_anything_runs(monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("measured before the memory check")
    monkeypatch.setattr(attention.yardstick, "measure", never)
    monkeypatch.setattr(attention, "build_caches", never)
    code = attention.main(["--device", "cpu", "--configs", "8x64", "2048x32768",
                           "--phases", "decode"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    for words in ("CacheTooLargeError", "attention b2048 ctx32768 (torch.float32)",
                  "2200096997376 bytes", "MemTotal", "--configs"):
        assert words in err, err


def test_the_charge_counts_the_source_twice_every_pool_and_the_process():
    args = attention.parse_args(["--device", "cpu", "--configs", "32x4096", "--vmem-layout",
                                 "per-layer", "interleaved", "--kv-cache-dtype", "auto", "fp8_e4m3"])
    per_layer_fp32 = 32 * 4096 * 2 * 8 * 128 * 4           # K and V of one layer: 1 GiB
    want = (PROCESS_BYTES + 2 * per_layer_fp32               # the source, and a write's copy
            + per_layer_fp32 * (1 + 2 + 1)                   # fp32: per-layer, 2-layer interleaved, paged
            + per_layer_fp32 // 4 * (1 + 2 + 1))             # fp8_e4m3: a quarter of the bytes
    assert bytes_needed(32, 4096, args, torch.device("cpu"), torch.float32) == want


def test_the_flush_buffer_is_charged_too(capsys):
    """``--flush-mib`` allocates a buffer read between timed calls: 10 TiB of it was allocated
    beside a configuration that fits."""
    code = attention.main(["--device", "cpu", "--configs", "1x64", "--phases", "decode",
                           "--flush-mib", str(10 << 20)])
    err = capsys.readouterr().err
    assert code == 2 and "attention b1 ctx64" in err and "CacheTooLargeError" in err
    args = attention.parse_args(["--device", "cpu", "--flush-mib", "64"])
    args_none = attention.parse_args(["--device", "cpu"])
    assert (bytes_needed(1, 64, args, torch.device("cpu"), torch.float32)
            - bytes_needed(1, 64, args_none, torch.device("cpu"), torch.float32)) == 64 << 20


@pytest.mark.parametrize("argv", [[], ["--quick"]])
def test_the_default_grids_fit_a_small_machine(argv):
    args = attention.parse_args(["--device", "cpu", *argv])
    biggest = max(bytes_needed(b, c, args, torch.device("cpu"), torch.float32)
                  for b, c in attention.grid(args))
    assert biggest <= 5 << 30                                # 5 GiB: b32 ctx4k fp32
