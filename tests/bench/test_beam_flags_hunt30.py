"""``benchmarks/beam.py``: a flag the chosen run does not read is refused by name (exit 2), as
``vmemkv bench`` refuses one (docs/errors.md); ``--widths`` is read by the simulator runs too.
Each was dropped in silence: ``--simulate-memory 2 --widths 3`` ran widths 2, 4 and 6,
``--simulate 9 --page-bytes 4KiB`` simulated 2 MiB pages, ``--cache-gb 60`` without a
simulation did nothing, and ``--simulate 9 --simulate-memory 9`` ran only the second."""
from __future__ import annotations

import json

import pytest

from vmemkv.benchmarks import beam


@pytest.mark.parametrize("argv, message", [
    (["--simulate", "2", "--simulate-memory", "2"],
     "--simulate and --simulate-memory are two different runs: give one"),
    (["--simulate", "2", "--page-bytes", "4KiB"], "--page-bytes sets the engine run and "
     "--simulate runs the simulator (llama-3-8b, 2 MiB pages, 16-token blocks), which would "
     "ignore it: drop it"),
    (["--simulate-memory", "2", "--block-sizes", "4"], "--block-sizes sets the engine run and "
     "--simulate-memory runs"),
    (["--simulate-memory", "2", "--model", "smollm2-135m-instruct"], "--model sets the engine run"),
    (["--simulate", "2", "--new-tokens", "8"], "--new-tokens sets the engine run"),
    (["--simulate", "2", "--prompts", "3"], "--prompts sets the engine run"),
    (["--cache-gb", "60", "--prompts", "1"], "--cache-gb sizes the simulator's cache: it applies "
     "with --simulate or --simulate-memory"),
])
def test_a_flag_the_chosen_run_would_ignore_is_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        beam.main(argv)
    assert exit_.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_the_simulated_memory_run_takes_the_widths_given(tmp_path):
    out = tmp_path / "beam.json"
    beam.main(["--simulate-memory", "2", "--widths", "3", "--out", str(out)])
    modes = [row["mode"] for row in json.loads(out.read_text())["rows"]]
    assert modes == ["beam 3"] * 3 + ["n 3"] * 3
