"""``--tp-timeout-s SECONDS`` (``vmemkv generate`` and ``serve``, beside ``--tp``) sets
``EngineConfig.tp_timeout_s``, which had no flag: a hung rank was waited for 60 s whatever the
command line said. A value the config would refuse is refused by argparse, naming the flag."""
from __future__ import annotations

from dataclasses import replace

import pytest

from vmemkv.cli import build_parser
from vmemkv.runtime import generate_checks, generate_cli
from vmemkv.runtime.engine import EngineConfig
from vmemkv.runtime.engine.errors import EngineConfigError


def engine_config(argv, command):
    """The EngineConfig ``generate_cli._engine`` builds the engine with for ``argv``."""
    args = build_parser().parse_args([command, *argv])
    generate_checks.check_flags(args)
    return generate_cli._engine(lambda model, tokenizer, **options:
                                replace(EngineConfig(), **options), None, None, args)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_flag_reaches_the_engine_config(command):
    assert engine_config(["--tp", "2", "--tp-timeout-s", "2.5"], command).tp_timeout_s == 2.5
    assert engine_config(["--tp", "2"], command).tp_timeout_s == EngineConfig.tp_timeout_s == 60


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("value", ["0", "-1", "1e6", "inf", "nan", "soon", "0.0005", "1e-300"])
def test_a_value_out_of_the_configs_range_is_refused_naming_the_flag(command, value, capsys):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args([command, "--tp", "2", "--tp-timeout-s", value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"vmemkv {command}: error: argument --tp-timeout-s: " in err and err.count("\n") <= 2


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("tp", [[], ["--tp", "1"]])
def test_the_flag_without_tensor_parallel_ranks_is_refused_naming_it(command, tp):
    """It did nothing without --tp N > 1 and was accepted (as --tp-devices is refused there)."""
    args = build_parser().parse_args([command, *tp, "--tp-timeout-s", "5"])
    with pytest.raises(generate_checks.GenerateUsageError, match=r"--tp-timeout-s 5 .*--tp N"):
        generate_checks.check_flags(args)


@pytest.mark.parametrize("timeout_s", [0.0005, 1e-300])
def test_a_timeout_under_a_millisecond_is_refused_it_meant_no_timeout(timeout_s):
    # torch's work.wait counts whole milliseconds, and 0 ms is its "no timeout" (kNoTimeout):
    # --tp-timeout-s 1e-300 ran with ranks waited on forever
    from vmemkv.runtime.engine.config import MIN_TP_TIMEOUT_S
    with pytest.raises(EngineConfigError, match=r"tp_timeout_s must be seconds in \[0.001, 1e6\)"):
        EngineConfig(tp_timeout_s=timeout_s)
    assert EngineConfig(tp_timeout_s=MIN_TP_TIMEOUT_S).tp_timeout_s == 0.001


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_vllms_tensor_parallel_size_is_the_same_flag(command, capsys):
    """A vLLM user's ``--tensor-parallel-size 2`` was an unrecognized argument."""
    assert engine_config(["--tensor-parallel-size", "2"], command).tensor_parallel_size == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--tensor-parallel-size", "0"])
    assert "argument --tp/--tensor-parallel-size: " in capsys.readouterr().err
