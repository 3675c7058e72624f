"""A run over saved results (``fidelity --refit FILE``, ``calibration_stability --from FILE``)
refuses by name a flag it would not read, as ``vmemkv bench`` does (docs/errors.md): each was
dropped in silence (``fidelity --refit f.json --json out.json`` wrote no out.json, and
``calibration_stability --from f.json --calibrations 5`` made none)."""
from __future__ import annotations

import pytest

from vmemkv.benchmarks import calibration_stability, fidelity


@pytest.mark.parametrize("argv, message", [
    (["--json", "out.json"], "--json would be ignored: --refit runs nothing and writes nothing"),
    (["--rate-scale", "2"], "--rate-scales would be ignored"),
    (["--requests", "8"], "--requests would be ignored"),
])
def test_fidelity_refit_refuses_a_flag_it_would_ignore(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        fidelity.main(["--refit", str(tmp_path / "saved.json"), *argv])
    assert exit_.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--calibrations", "5"], "--calibrations"), (["--max-repeats", "4"], "--max-repeats"),
    (["--join-lengths", "4"], "--join-lengths"),
])
def test_calibration_stability_from_refuses_a_calibration_flag(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        calibration_stability.main(["--from", str(tmp_path / "saved.json"), *argv])
    assert exit_.value.code == 2
    assert (f"error: {flag} sets the calibrations this run would make, and --from compares "
            f"saved ones instead: drop it") in capsys.readouterr().err
