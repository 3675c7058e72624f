"""The device-profile cost model: arithmetic, loading, and use in the simulator (no torch)."""
import json

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_cost import PROFILE_FORMAT, ProfileCost, load_profile
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=4,
             weight_bytes=1_000_000)
COEFFS = dict(base_s=0.002, per_seq_s=1e-5, per_new_token_s=1e-4, per_context_token_s=1e-6)


def write_profile(tmp_path, **changes) -> str:
    profile = {"format": PROFILE_FORMAT, "version": 1, "model": MODEL, "coefficients": COEFFS}
    profile.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return str(path)


def test_step_seconds_is_the_documented_linear_form():
    cost = ProfileCost(**COEFFS, map_latency_s=1e-6)
    assert cost.step_seconds(1000, 10, 3, num_seqs=4) == pytest.approx(
        0.002 + 4e-5 + 1e-3 + 1e-3 + 3e-6)


def test_negative_coefficient_is_refused_naming_it():
    with pytest.raises(ConfigError, match="per_seq_s"):
        ProfileCost(base_s=0, per_seq_s=-1, per_new_token_s=0, per_context_token_s=0)


def test_simulator_with_a_profile_charges_its_step_time(tmp_path):
    path = write_profile(tmp_path)
    entries = generate(WorkloadSpec(num_requests=20, max_total_len=256, seed=1))
    r = simulate(entries, SimConfig(policy="paged", profile=path, cache_bytes=8 * 10**6,
                                    max_seq_len=256))
    assert r.output_tokens == sum(e.output_len for e in entries)
    # every step costs at least base_s + one sequence + one token
    assert r.simulated_seconds >= r.num_steps * (0.002 + 1e-5 + 1e-4)
    roofline = simulate(entries, SimConfig(policy="paged", model="tiny", cache_bytes=8 * 10**6,
                                           max_seq_len=256))
    assert roofline.simulated_seconds != r.simulated_seconds


@pytest.mark.parametrize("changes,words", [
    (dict(format="other"), "not a vmemkv-device-profile"),
    (dict(coefficients={"base_s": 1}), "coefficients"),
    (dict(model={"name": "x"}), "model"),
])
def test_bad_profile_is_a_config_error_naming_the_file(tmp_path, changes, words):
    path = write_profile(tmp_path, **changes)
    with pytest.raises(ConfigError, match=words):
        load_profile(path)
    with pytest.raises(ConfigError, match="profile"):
        SimConfig(profile=path)


def test_missing_profile_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="nope.json"):
        load_profile(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_every_version_written_so_far_loads(tmp_path, version):
    extra = {"coefficient_intervals": {k: [0.0, v * 2] for k, v in COEFFS.items()}} \
        if version == 3 else {}
    profile = load_profile(write_profile(tmp_path, version=version, **extra))
    assert profile["coefficients"] == COEFFS


@pytest.mark.parametrize("version", [4, 0, "3", True])
def test_a_version_this_code_does_not_know_is_refused_by_name(tmp_path, version):
    with pytest.raises(ConfigError, match=f"version {version!r} is not one this vmemkv reads"):
        load_profile(write_profile(tmp_path, version=version))
