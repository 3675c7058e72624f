"""``--tp-devices`` on ``vmemkv generate``, ``serve`` and ``bench``: the value reaches the engine's
``tp_devices``; it is refused, naming the value, without ``--tp`` N > 1 or for a CPU model, and
otherwise checked by the API's own rules and messages before any model is loaded."""
from __future__ import annotations

import pytest
import torch

from vmemkv.cli import build_parser, main
from vmemkv.runtime import generate_cli
from vmemkv.runtime.distributed import TensorParallelConfigError


class RecordedEngine:
    """Records the keywords ``generate_cli._engine`` builds an engine with."""

    def __init__(self, model, tokenizer, **options) -> None:
        self.options = options


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_tp_devices_reach_the_engine_as_the_apis_device_list(command):
    args = build_parser().parse_args([command, "--device", "cuda", "--tp", "2",
                                      "--tp-devices", "cuda:0, 2"])
    engine = generate_cli._engine(RecordedEngine, None, None, args)
    assert engine.options["tp_devices"] == ("cuda:0", 2)
    assert engine.options["tensor_parallel_size"] == 2
    default = build_parser().parse_args([command])
    assert generate_cli._engine(RecordedEngine, None, None, default).options["tp_devices"] is None


@pytest.mark.parametrize("argv, match", [
    (["generate", "--tp-devices", "cuda:0,cuda:1"],
     "--tp-devices cuda:0,cuda:1 sets the devices of tensor-parallel ranks but --tp is 1"),
    (["generate", "--tp", "2", "--tp-devices", "cpu,cpu"],
     "--tp-devices cpu,cpu places ranks on GPUs but the model runs on cpu"),
    (["bench", "--tp-devices", "cuda:0,cuda:1"],
     "--tp-devices cuda:0,cuda:1 sets the devices of tensor-parallel ranks but --tp is not given"),
    (["bench", "--tp", "2", "--device", "cpu", "--tp-devices", "cuda:0,cuda:1"],
     "--tp-devices cuda:0,cuda:1 places ranks on GPUs but the model runs on cpu"),
])
def test_tp_devices_without_tp_or_on_a_cpu_model_exit_2_naming_the_value(argv, match, capsys,
                                                                         tmp_path):
    assert main(argv + (["--out", str(tmp_path)] if argv[0] == "bench" else [])) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())      # bench refused before writing anything


@pytest.mark.parametrize("devices, match", [
    ("cuda:0,cuda:5", "tp_devices names cuda:5, but the visible CUDA devices are cuda:0..cuda:1"),
    ("cuda:0", r"tp_devices names 1 device\(s\) \['cuda:0'\] but tensor_parallel_size is 2"),
    ("cuda:0,", "tp_devices entry '' is not a device"),
    ("cuda:0,gpu:1", "tp_devices entry 'gpu:1' is not a device"),
    ("cuda:1,cuda:0", "tp_devices starts with cuda:1 but the model is on cuda:0"),
    ("0,0", "names a device twice"),
])
def test_a_gpu_device_list_is_checked_by_the_apis_rules_before_the_model_loads(
        devices, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)     # two GPUs, as if visible
    args = build_parser().parse_args(["generate", "--device", "cuda:0", "--tp", "2",
                                      "--tp-devices", devices])
    with pytest.raises(TensorParallelConfigError, match=match):
        generate_cli._check_flags(args)


def test_a_device_list_the_api_accepts_passes_the_cli_checks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    args = build_parser().parse_args(["generate", "--device", "cuda:0", "--tp", "2",
                                      "--tp-devices", "cuda:0,3"])
    generate_cli._check_flags(args)
