"""A swap space without swap preemption is refused by name, not ignored: ``--swap-bytes`` (and
``EngineConfig.swap_bytes``) with recompute preemption was taken, no sequence ever swapped,
and the engine still held the swap bytes aside from what ``resize_cache`` could grow into."""
from __future__ import annotations

import pytest

from vmemkv.cli import main
from vmemkv.runtime.engine import EngineConfig, EngineConfigError


def test_engine_config_refuses_a_swap_space_without_swap_preemption():
    with pytest.raises(EngineConfigError, match=r"^EngineConfig\.swap_bytes \(1048576\) is the "
                       r"host swap space of preemption='swap'; with preemption='recompute' .*"
                       r"set preemption='swap' or swap_bytes=0$"):
        EngineConfig(swap_bytes=1 << 20)
    assert EngineConfig(preemption="swap", swap_bytes=1 << 20).swap_bytes == 1 << 20
    assert EngineConfig(swap_bytes=0).preemption == "recompute"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_cli_refuses_swap_bytes_without_swap_preemption_before_the_model_loads(
        command, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("1 2 3\n")
    argv = ["--prompts", str(prompts)] if command == "generate" else ["--port", "0"]
    # a model name that does not exist: had the refusal come after loading, it would name that
    code = main([command, "--model", "no-such-model", *argv, "--swap-bytes", "1GiB"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"vmemkv {command}: error: GenerateUsageError: --swap-bytes "
                          f"1073741824 is the host swap space of --preemption swap; with "
                          f"--preemption recompute no sequence swaps")
