"""benchmarks/fidelity.py --compare-fits writes each fit's profile beside --profile's, whatever
its name (config.profile[:-5] made --profile sub/cal write su.fitN.json in the current folder,
over a user's file), and checks those paths before anything runs."""
import json
import os
from dataclasses import dataclass

import pytest

from vmemkv.benchmarks import calibration_stability, fidelity


@dataclass
class _Config:
    profile: str


class _Report:
    def report(self):
        return {k: 2.0 for k in fidelity.FIGURES}


@pytest.mark.parametrize("name", ["sub/cal", "sub/cal.json", "sub.d/cal"])
def test_compare_fits_writes_beside_the_profile_and_nowhere_else(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    os.makedirs(os.path.dirname(name))
    with open(name, "w") as f:
        json.dump({"points": [1, 2], "coefficients": {"a": 0}}, f)
    (tmp_path / "su.fit0.json").write_text("precious")
    monkeypatch.setattr(calibration_stability, "FITS",
                        {"one": lambda points: {"a": 1}, "two": lambda points: {"a": 2}})
    monkeypatch.setattr(fidelity, "simulate", lambda entries, config: _Report())
    out = fidelity.other_fits([], _Config(name), {k: 1.0 for k in fidelity.FIGURES})
    assert out["one"]["rel_error"]["median_ttft_ms"] == 1.0
    folder, stem = os.path.dirname(name), os.path.splitext(name)[0]
    assert sorted(os.listdir(folder)) == sorted([os.path.basename(name), f"{os.path.basename(stem)}.fit0.json",
                                                 f"{os.path.basename(stem)}.fit1.json"])
    assert json.load(open(f"{stem}.fit1.json"))["coefficients"] == {"a": 2}
    assert (tmp_path / "su.fit0.json").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == sorted([folder, "su.fit0.json"])


def test_compare_fits_paths_are_checked_before_anything_runs(tmp_path, capsys):
    (tmp_path / "cal.fit0.json").mkdir()
    with pytest.raises(SystemExit) as exit_:
        fidelity.parse_args(["--profile", str(tmp_path / "cal.json"), "--compare-fits"])
    assert exit_.value.code == 2
    assert (f"--compare-fits writes each fit's profile beside --profile: "
            f"{tmp_path / 'cal.fit0.json'} is a folder: give a file name") in capsys.readouterr().err
    (tmp_path / "cal.json").write_text(json.dumps({    # --profile itself is checked (hunt 32)
        "format": "vmemkv-device-profile", "version": 1,
        "model": dict(name=fidelity.MODEL, num_layers=4, num_kv_heads=2, head_dim=32,
                      dtype_bytes=4, weight_bytes=6291456),
        "coefficients": dict(base_s=1e-3, per_seq_s=0, per_new_token_s=0, per_context_token_s=0)}))
    assert fidelity.parse_args(["--profile", str(tmp_path / "cal.json")]).profile   # no fits: no check
