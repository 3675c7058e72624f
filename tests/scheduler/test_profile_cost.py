"""The device-profile cost model: arithmetic, loading, and use in the simulator (no torch)."""
import json

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_cost import (FITTED, PROFILE_FORMAT, ProfileCost, load_profile,
                                           profile_cost)
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=4,
             weight_bytes=1_000_000)
COEFFS = dict(base_s=0.002, per_seq_s=1e-5, per_new_token_s=1e-4, per_context_token_s=1e-6)
ALL_COEFFS = {**dict.fromkeys(FITTED, 0.0), **COEFFS}        # what versions 2-4 must have


def write_profile(tmp_path, **changes) -> str:
    profile = {"format": PROFILE_FORMAT, "version": 1, "model": MODEL, "coefficients": COEFFS}
    profile.update(changes)
    tmp_path.mkdir(exist_ok=True)
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


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_every_version_written_so_far_loads(tmp_path, version):
    coeffs = COEFFS if version == 1 else ALL_COEFFS
    extra = {"coefficient_intervals": {k: [0.0, v * 2] for k, v in coeffs.items()}} \
        if version >= 3 else {}
    model = {**MODEL, "layer_windows": [None, None]} if version >= 4 else MODEL
    profile = load_profile(write_profile(tmp_path, version=version, coefficients=coeffs,
                                         model=model, **extra))
    assert profile["coefficients"] == coeffs
    # versions 1-3 have no layer_windows: every layer attends to all tokens, as before
    assert SimConfig(profile=write_profile(tmp_path, version=version, coefficients=coeffs,
                                           model=model)).model_spec.window_tokens is None


@pytest.mark.parametrize("windows,window_tokens,hybrid", [([8, 8], 8, False),
                                                          ([8, None], None, True)])
def test_a_profile_records_its_models_sliding_windows(tmp_path, windows, window_tokens, hybrid):
    path = write_profile(tmp_path, version=4, coefficients=ALL_COEFFS,
                         model={**MODEL, "layer_windows": windows})
    spec = SimConfig(profile=path).model_spec
    assert spec.layer_windows == tuple(windows) and spec.window_tokens == window_tokens
    assert spec.is_hybrid == hybrid
    # a sliding window gives back what is behind it: less memory held than all-full layers
    entries = generate(WorkloadSpec(num_requests=8, max_total_len=256, seed=1))
    config = dict(policy="vmem", page_bytes=4096, cache_bytes=8 * 10**6, max_seq_len=256)
    full = write_profile(tmp_path / "full", version=4, coefficients=ALL_COEFFS,
                         model={**MODEL, "layer_windows": [None, None]})
    windowed = simulate(entries, SimConfig(profile=path, **config))
    assert windowed.kv_cache_usage_perc < simulate(
        entries, SimConfig(profile=full, **config)).kv_cache_usage_perc


@pytest.mark.parametrize("model,words", [
    (MODEL, "layer_windows"),                                  # version 4 must say
    ({**MODEL, "layer_windows": [8]}, "one None / int >= 1 per layer"),
    ({**MODEL, "layer_windows": [8, 0]}, "one None / int >= 1 per layer"),
])
def test_a_version_4_model_entry_without_good_windows_is_refused(tmp_path, model, words):
    with pytest.raises(ConfigError, match=words):
        load_profile(write_profile(tmp_path, version=4, coefficients=ALL_COEFFS, model=model))


@pytest.mark.parametrize("text", ["Infinity", "NaN", "1e300", "3600", "1" + "0" * 400, "-1"])
def test_a_coefficient_not_finite_or_absurd_is_refused_naming_it_and_the_file(tmp_path, text):
    path = write_profile(tmp_path, coefficients={**COEFFS, "base_s": 0.5})
    with open(path) as f:
        raw = f.read().replace('"base_s": 0.5', f'"base_s": {text}')
    with open(path, "w") as f:
        f.write(raw)
    with pytest.raises(ConfigError, match=r"profile\.json: profile coefficient base_s must be "
                                          r"a number in \[0, 3600\) seconds"):
        load_profile(path)


V4_MODEL = {**MODEL, "layer_windows": [None] * MODEL["num_layers"]}


@pytest.mark.parametrize("change,words", [
    (lambda c: c.pop("per_cold_step_s"), "missing per_cold_step_s"),
    (lambda c: c.update(per_prefil_step_s=c.pop("per_prefill_step_s")),
     "missing per_prefill_step_s"),
    (lambda c: c.update(bogus_s=1.0), "unknown 'bogus_s'"),
])
def test_a_version_4_coefficient_missing_or_misspelled_is_refused_by_name(tmp_path, change,
                                                                          words):
    coeffs = dict(ALL_COEFFS)
    change(coeffs)
    with pytest.raises(ConfigError, match=f"version 4 coefficients must have .*{words}"):
        load_profile(write_profile(tmp_path, version=4, model=V4_MODEL, coefficients=coeffs))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_profiles_before_version_4_load_as_they_did_with_what_they_lack_0(tmp_path, version):
    # calibrates of version 2 wrote the optional coefficients as they were added ({pair},
    # {pair, cold}, ...): requiring them all refused the files they wrote; a typo still is not
    # taken for a coefficient (it was charged as 0)
    cost = profile_cost(load_profile(write_profile(
        tmp_path, version=version, coefficients={**COEFFS, "per_prefill_pair_s": 1e-8})))
    assert cost.per_prefill_pair_s == 1e-8 and cost.per_idle_wake_s == cost.per_cold_step_s == 0.0
    with pytest.raises(ConfigError, match="unknown 'per_prefil_pair_s'"):
        load_profile(write_profile(tmp_path, version=version,
                                   coefficients={**COEFFS, "per_prefil_pair_s": 1e-8}))


@pytest.mark.parametrize("version", [5, 0, "3", True])
def test_a_version_this_code_does_not_know_is_refused_by_name(tmp_path, version):
    with pytest.raises(ConfigError, match=f"version {version!r} is not one this vmemkv reads"):
        load_profile(write_profile(tmp_path, version=version))


@pytest.mark.parametrize("engine,words", [
    ({"max_batch": "abc"}, "engine max_batch 'abc' is not an int >= 1"),
    ({"max_context": True}, "engine max_context True is not an int >= 1"),
    ({"cache": "blocks"}, "engine cache 'blocks' is not one of vmem, paged"),
    ([4], "engine must be an object"),
])
def test_a_bad_engine_entry_is_refused_naming_it(tmp_path, engine, words):
    with pytest.raises(ConfigError, match=words):
        load_profile(write_profile(tmp_path, engine=engine))
