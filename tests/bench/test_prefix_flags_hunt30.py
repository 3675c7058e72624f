"""``benchmarks/prefix.py``: ``--device cuda`` where torch sees no GPU is one line naming the
flag (exit 2) before the environment line (it was ``AssertionError: Torch not compiled with CUDA
enabled``, a traceback), and a flag the chosen run does not read is refused by name: ``--trace``
runs the simulator only (``--quick``, ``--device``, ``--repeats`` were dropped in silence) and
``--cache-gb`` sizes only its cache (without ``--trace`` it did nothing)."""
from __future__ import annotations

import pytest
import torch

from vmemkv.benchmarks import prefix
from vmemkv.cli import command_status


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_device_cuda_without_a_gpu_is_one_line_naming_the_flag(capsys):
    assert command_status("prefix", lambda: prefix.main(["--quick", "--device", "cuda"])) == 2
    assert capsys.readouterr().err == ("prefix: error: --device 'cuda' asked for, but no CUDA "
                                       "GPU is visible to torch\n")


@pytest.mark.parametrize("argv, message", [
    (["--trace", "3", "--quick"], "--quick sets the engine run and --trace runs the simulator, "
     "which would ignore it: drop it"),
    (["--trace", "3", "--device", "cpu"], "--device sets the engine run"),
    (["--trace", "3", "--repeats", "1"], "--repeats sets the engine run"),
    (["--quick", "--cache-gb", "8"], "--cache-gb sizes the simulator's cache: it applies with "
     "--trace"),
])
def test_a_flag_the_chosen_run_would_ignore_is_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        prefix.main(argv)
    assert exit_.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err
