"""Hand-edited and odd device profiles (hunt 30): what load_profile refuses by name instead of
loading something that fails later, is silently dropped, or touches what it does not own."""
import json
import os

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.profile_cost import FITTED, PROFILE_FORMAT, load_profile
from vmemkv.scheduler.simulator import SimConfig

MODEL = dict(name="toy", num_layers=2, num_kv_heads=2, head_dim=32, dtype_bytes=4,
             weight_bytes=1_000_000, layer_windows=[None, None])
COEFFS = {**dict.fromkeys(FITTED, 0.0), "base_s": 1e-3, "per_new_token_s": 1e-5}
ENGINE = dict(cache="vmem", layout="per-layer", page_bytes=65536, max_batch=4, max_context=128,
              max_tokens_per_step=2048)


def write_profile(tmp_path, version=4, model=MODEL, engine=ENGINE) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": version, "model": model,
                                "coefficients": COEFFS, "engine": engine}))
    return str(path)


def test_a_profile_that_is_not_a_file_name_is_refused_and_no_descriptor_is_read_or_closed():
    # open(fd) read the caller's descriptor and closed it (SimConfig(profile=True): stdout)
    read_end, write_end = os.pipe()
    os.write(write_end, b"{}")
    os.close(write_end)
    try:
        for profile in (read_end, True, ["p.json"]):       # a list was a TypeError
            with pytest.raises(ConfigError, match="device profile must be a file name"):
                load_profile(profile)
        with pytest.raises(ConfigError, match="device profile must be a file name"):
            SimConfig(policy="paged", profile=read_end)
        os.fstat(read_end)                                  # still open, unread
        assert os.read(read_end, 8) == b"{}"
    finally:
        os.close(read_end)


def test_a_profile_nested_too_deeply_is_a_config_error_and_exit_2(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)         # a RecursionError traceback
    with pytest.raises(ConfigError, match="deep.json: nested too deeply"):
        load_profile(str(path))
    assert main(["simulate", "--profile", str(path), "--requests", "2", "--no-progress"]) == 2
    assert "nested too deeply" in capsys.readouterr().err


@pytest.mark.parametrize("version", [3, 4])
def test_layer_windows_null_is_refused_by_name_not_a_type_error_in_the_run(tmp_path, version):
    # it loaded, and a vmem simulation failed with "'NoneType' object is not iterable"
    path = write_profile(tmp_path, version, model={**MODEL, "layer_windows": None})
    with pytest.raises(ConfigError, match="bad model entry: layer_windows must be a list, per "
                                          "layer the window in tokens or null, got None"):
        load_profile(path)


@pytest.mark.parametrize("key", ["max_batchs", "max_len", "policy"])
def test_an_engine_setting_no_calibrate_writes_is_refused_by_name(tmp_path, capsys, key):
    # a misspelt max_batch was dropped: simulate --profile ran its own default (16), no warning
    engine = {k: v for k, v in ENGINE.items() if k != "max_batch"}
    path = write_profile(tmp_path, engine={**engine, key: 4})
    with pytest.raises(ConfigError, match=f"engine has unknown '{key}'; its settings are cache, "
                                          f"layout, page_bytes, max_batch, max_context, "
                                          f"max_tokens_per_step"):
        load_profile(path)
    assert main(["simulate", "--profile", path, "--requests", "2", "--cache-gb", "0.01",
                 "--no-progress"]) == 2
    assert f"unknown '{key}'" in capsys.readouterr().err
