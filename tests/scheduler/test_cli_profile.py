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


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 4, "model": MODEL,
                                "coefficients": COEFFS, "engine": ENGINE}))
    return str(path)


def run(argv, capsys):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return json.loads(out)["config"], err


def test_the_profiles_engine_is_the_default_of_every_flag_not_given(profile, capsys):
    config, err = run(RUN + ["--profile", profile], capsys)
    assert err == ""            # the defaults were 1,024 running, 8,192 tokens, paged, 4,096
    assert (config["policy"], config["page_size"], config["layout"], config["max_running"],
            config["max_tokens_per_step"]) == ("vmem", 65536, "per-layer", 4, 2048)
    # max_context 128 in whole page groups, as the engine's vmem slot was built; paged: 128
    assert config["max_len"] == 256
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
