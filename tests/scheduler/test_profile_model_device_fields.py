"""``SimConfig(profile=...)`` with a ``model`` other than the default or the profile's own, or a
``device`` other than the default, is refused naming the field, as the command line refuses
``--model-preset`` and ``--gpu`` with ``--profile``: the profile's model was simulated under the
name given, and the device dropped, silently."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.simulator import SimConfig

from .test_cli_profile import write_profile


@pytest.mark.parametrize("field, value, words", [
    ("model", "mistral-7b-v0.1", "model 'mistral-7b-v0.1' with a profile of 'toy'"),
    ("device", "h200", "device 'h200' with a profile"),
])
def test_a_model_or_device_the_profile_drops_is_refused(tmp_path, field, value, words):
    with pytest.raises(ConfigError, match=words):
        SimConfig(policy="vmem", profile=write_profile(tmp_path), **{field: value})


def test_the_default_or_the_profiles_own_model_is_taken(tmp_path):
    path = write_profile(tmp_path)
    assert SimConfig(policy="vmem", profile=path).model_spec.name == "toy"
