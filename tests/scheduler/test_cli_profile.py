"""`vmemkv simulate --profile`: the engine the profile timed gives the defaults, a flag given
outside it is warned of, the roofline's own knobs are refused by name, and the JSON records
the model that was simulated (no torch)."""
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.profile_cost import FITTED, PROFILE_FORMAT

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=4,
             weight_bytes=1_000_000, layer_windows=[None, None])
COEFFS = {**dict.fromkeys(FITTED, 0.0), "base_s": 1e-3, "per_new_token_s": 1e-5}
# 256 bytes a token a layer: a 64 KiB per-layer page holds 256 tokens
ENGINE = dict(cache="vmem", layout="per-layer", page_bytes=65536, max_batch=4, max_context=128,
              max_tokens_per_step=2048)
RUN = ["simulate", "--requests", "20", "--cache-gb", "0.01", "--no-progress", "--json"]


def write_profile(tmp_path, model=MODEL, engine=ENGINE, coefficients=COEFFS) -> str:
    """A version-4 device profile of ``model`` timed on ``engine``, as ``vmemkv calibrate``
    writes one; its path."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 4, "model": model,
                                "coefficients": coefficients, "engine": engine}))
    return str(path)


@pytest.fixture
def profile(tmp_path):
    return write_profile(tmp_path)


def run(argv, capsys):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return json.loads(out)["config"], err


def test_the_profiles_engine_is_the_default_of_every_flag_not_given(profile, capsys):
    config, err = run(RUN + ["--profile", profile], capsys)
    assert err == ""            # the defaults were 1,024 running, 8,192 tokens, paged, 4,096
    assert (config["policy"], config["page_size_bytes"], config["layout"], config["max_running"],
            config["max_tokens_per_step"]) == ("vmem", 65536, "per-layer", 4, 2048)
    # max_context 128: what the engine admits (its vmem slots hold 256 in whole pages; the
    # default was the slot, so requests drawn up to 256 tokens ran that the engine refuses)
    assert config["max_len"] == 128
    assert run(RUN + ["--profile", profile, "--policy", "paged"], capsys)[0]["max_len"] == 128


def test_a_flag_given_inside_what_was_timed_is_used_silently(profile, capsys):
    config, err = run(RUN + ["--profile", profile, "--max-running", "2", "--layout", "per-layer"],
                      capsys)
    assert err == "" and config["max_running"] == 2 and config["max_tokens_per_step"] == 2048


def test_a_flag_given_outside_what_was_timed_is_warned_of_one_line_each(profile, capsys):
    config, err = run(RUN + ["--profile", profile, "--policy", "paged", "--max-running", "8",
                             "--max-len", "4096", "--max-tokens-per-step", "2048"], capsys)
    assert config["policy"] == "paged" and config["max_running"] == 8
    assert err.splitlines() == [
        f"vmemkv simulate: warning: --policy paged is not the cache vmem that {profile} timed: "
        f"its step costs are not measured there",
        f"vmemkv simulate: warning: --max-running 8 is above the max_batch 4 that {profile} "
        f"timed: its step costs are extrapolated there",
        f"vmemkv simulate: warning: --max-len 4096 is above the max_context 128 that {profile} "
        f"timed: its step costs are extrapolated there"]


def test_the_json_records_the_profiles_model_not_the_preset(profile, capsys):
    config, _ = run(RUN + ["--profile", profile], capsys)
    assert config["profile"] == profile and config["profile_model"] == "toy"
    assert config["model_preset"] is None and config["gpu"] is None


@pytest.mark.parametrize("flags,words", [
    (["--paged-slowdown", "5"], "paged_slowdown 5.0 with a profile: it tunes the roofline"),
    (["--prefill-mfu", "0.01"], "prefill_mfu 0.01 with a profile: it tunes the roofline"),
    (["--kv-cache-dtype", "fp8_e4m3"], "leave it auto, or simulate that cache on the roofline"),
])
def test_a_roofline_knob_with_a_profile_is_refused_by_name(profile, capsys, flags, words):
    assert main(RUN + ["--profile", profile] + flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert "calibrate with that cache" not in err      # calibrate has no such flag


@pytest.mark.parametrize("value", ["Infinity", "1e300", "1" + "0" * 400])
def test_a_coefficient_past_any_measurement_is_one_line_exit_2(profile, capsys, value):
    with open(profile) as f:
        text = f.read().replace('"base_s": 0.001', f'"base_s": {value}')
    with open(profile, "w") as f:
        f.write(text)
    assert main(RUN + ["--profile", profile]) == 2       # inf ran; 10**400 was a traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "base_s must be a number in [0, 3600) seconds" in err


def test_the_simulator_admits_max_len_in_slots_rounded_up_to_whole_pages():
    from vmemkv.scheduler.simulator import SimConfig, simulate
    from vmemkv.scheduler.workload import WorkloadSpec, generate
    config = SimConfig(policy="vmem", cache_bytes=10**8, max_seq_len=100, page_bytes=65536)
    manager = config.make_manager()
    assert config.slot_tokens == manager.max_seq_len > 100          # whole pages a slot
    assert config.scheduler_for(manager).max_seq_len == 100         # the engine's admission
    result = simulate(generate(WorkloadSpec(num_requests=20, max_total_len=100, seed=1)), config)
    assert result.report()["completed"] == 20


def test_a_larger_max_running_raises_the_profiles_tokens_per_step_and_warns(profile, capsys):
    config, err = run(RUN + ["--profile", profile, "--max-running", "4096"], capsys)
    assert config["max_tokens_per_step"] == 4096     # was exit 2 naming a 2048 nobody gave
    assert "--max-tokens-per-step 4096 is above the max_tokens_per_step 2048" in err


def test_auto_is_compared_as_it_resolves_and_a_profiles_value_is_named_so(profile, capsys,
                                                                          tmp_path):
    # on the toy's 64 KiB pages auto resolves to interleaved: a warning against a per-layer
    # profile, none against an interleaved one (it warned "auto is not interleaved")
    _, err = run(RUN + ["--profile", profile, "--layout", "auto"], capsys)
    assert "--layout auto (interleaved here) is not the layout per-layer" in err
    interleaved = tmp_path / "interleaved.json"
    interleaved.write_text(open(profile).read().replace('"per-layer"', '"interleaved"'))
    _, err = run(RUN + ["--profile", str(interleaved), "--layout", "auto"], capsys)
    assert err == ""
    assert main(RUN + ["--profile", profile, "--policy", "paged", "--block-size", "256"]) == 2
    assert "--block-size 256 tokens is longer than --max-len (from " in capsys.readouterr().err


def test_a_profile_asking_for_an_absurd_engine_is_refused_not_built(profile, capsys, tmp_path):
    path = tmp_path / "huge.json"
    text = open(profile).read().replace('"max_context": 128', '"max_context": 1000000000000')
    path.write_text(text)
    assert main(RUN + ["--profile", str(path)]) == 2          # it hung building the slots
    assert "engine max_context 1000000000000 is above 10,000,000" in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--model-preset", "mistral-7b-v0.1"],
     "--model-preset mistral-7b-v0.1 is not the model toy that --profile"),
    (["--gpu", "h200"], "--gpu h200 with --profile"),
    (["--model-preset", "phi-2", "--gpu", "h200"], "--model-preset phi-2 is not the model toy"),
    (["--model-preset", "llama-3-8b"], "--model-preset llama-3-8b is not the model toy"),
    (["--gpu", "h100"], "--gpu h100 with --profile"),       # given at their defaults
])
def test_a_model_or_gpu_beside_a_profile_is_refused_by_flag_not_dropped(profile, capsys, flags,
                                                                        words):
    # both ran the profile's model silently, the JSON naming neither the preset nor the GPU
    assert main(RUN + ["--profile", profile] + flags) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err, err


def test_the_profiles_own_model_named_as_the_preset_is_allowed(profile, capsys, tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(open(profile).read().replace('"name": "toy"', '"name": "tiny"'))
    config, err = run(RUN + ["--profile", str(path), "--model-preset", "tiny"], capsys)
    assert err == "" and config["profile_model"] == "tiny"


def test_the_check_counts_a_flag_given_at_its_default_as_given(profile):
    import argparse
    from vmemkv.scheduler.cli_checks import check_profile_model
    from vmemkv.scheduler.errors import ConfigError
    from vmemkv.scheduler.profile_cost import load_profile
    args = argparse.Namespace(profile=profile, model_preset="llama-3-8b", gpu="h100",
                              given=frozenset({"model_preset"}))
    with pytest.raises(ConfigError, match="--model-preset llama-3-8b is not the model toy"):
        check_profile_model(args, load_profile(profile))
    check_profile_model(argparse.Namespace(**{**vars(args), "given": frozenset()}),
                        load_profile(profile))       # the defaults, not given: the profile's
