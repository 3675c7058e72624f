"""Pins of ``vmemkv generate``'s input, output and flag checks (runtime/generate_io.py,
generate_checks.py, generate_cli.py): each test holds one promise of a docstring or --help."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.runtime.generate_io import format_output, name_prompt_line


def test_a_labelled_sample_indents_each_further_line():
    out = SimpleNamespace(request_id=1, outputs=[
        SimpleNamespace(index=0, text="first\nsecond\nthird", token_ids=[5, 6])])
    assert format_output(out, as_json=False, labelled=True) == \
        "[prompt 1 sample 0] first\n    second\n    third\n"


def test_a_prompt_index_past_the_lines_is_left_as_it_is():
    error = RequestRejectedError("prompt 2 rejected: too long", 2)
    assert name_prompt_line(error, [1, 4]) is error and str(error) == "prompt 2 rejected: too long"
    named = name_prompt_line(RequestRejectedError("prompt 1 rejected: too long", 1), [1, 4])
    assert str(named) == "prompt line 4 rejected: too long"


def test_tp_devices_with_one_rank_names_tp():
    from vmemkv.runtime.generate_checks import check_tp_devices
    from vmemkv.runtime.generate_io import GenerateUsageError
    with pytest.raises(GenerateUsageError, match="--tp-devices 0,1 sets the devices of "
                                                 "tensor-parallel ranks but --tp is 1"):
        check_tp_devices((0, 1), 1, "cpu")


def _generate_args(*flags):
    from vmemkv.cli import build_parser
    return build_parser().parse_args(["generate", *flags])


def test_a_tp_timeout_without_ranks_is_refused():
    from vmemkv.runtime.generate_checks import check_flags
    from vmemkv.runtime.generate_io import GenerateUsageError
    with pytest.raises(GenerateUsageError, match="^--tp-timeout-s 5 bounds how long a step"):
        check_flags(_generate_args("--tp", "1", "--tp-timeout-s", "5"))


def test_ctrl_c_prints_only_the_samples_that_finished(capsys):
    from dataclasses import dataclass, field

    from vmemkv.runtime.generate_cli import _print_finished

    @dataclass
    class Out:
        request_id: int
        outputs: list = field(default_factory=list)

    sample = lambda index, ids: SimpleNamespace(index=index, text=None, token_ids=ids)  # noqa: E731
    outs = {0: Out(0, [sample(0, [7, 8]), sample(1, [9])]), 1: Out(1, [sample(0, [4])])}
    engine = SimpleNamespace(output=outs.__getitem__)
    _print_finished(engine, [(1, 0), (0, 1)], as_json=False)
    assert capsys.readouterr().out == "[prompt 0 sample 1] 9\n[prompt 1 sample 0] 4\n"


def test_the_json_stats_write_infinity_and_nan_as_null():
    from vmemkv.runtime.generate_cli import _finite
    assert _finite({"tokens_per_s": float("inf"), "itl_p50_s": float("nan"), "requests": 2,
                    "ttft_p50_s": 0.25}) == \
        {"tokens_per_s": None, "itl_p50_s": None, "requests": 2, "ttft_p50_s": 0.25}


def test_a_tp_timeout_of_zero_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        _generate_args("--tp", "2", "--tp-timeout-s", "0")
    assert exit_.value.code == 2
    assert "--tp-timeout-s: must be in [0.001, 1000000.0), got 0" in capsys.readouterr().err
