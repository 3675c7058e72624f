"""ModelSpec names the field at fault: a bad ``num_layers`` was reported as ``layer_windows``
not one entry per layer (the windows were checked first, against the bad count), a bool
passed as a count (``True`` layers), and a ``weight_bytes`` that is no int was a TypeError from
the comparison (or, as a float, taken)."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.presets import ModelSpec

GOOD = dict(name="m", num_layers=2, num_kv_heads=1, head_dim=8, dtype_bytes=2, weight_bytes=0,
            layer_windows=(None, 4))


@pytest.mark.parametrize("field, value, words", [
    ("num_layers", -2, "ModelSpec.num_layers must be a positive int, got -2"),
    ("num_layers", True, "ModelSpec.num_layers must be a positive int, got True"),
    ("head_dim", 0, "ModelSpec.head_dim must be a positive int, got 0"),
    ("weight_bytes", "x", "ModelSpec.weight_bytes must be an int >= 0, got 'x'"),
    ("weight_bytes", 1.5, "ModelSpec.weight_bytes must be an int >= 0, got 1.5"),
    ("layer_windows", (None,), "ModelSpec.layer_windows must be () or one None / int >= 1 per "
                               "layer (2), got (None,)"),
])
def test_the_field_at_fault_is_named(field, value, words):
    with pytest.raises(ConfigError) as refused:
        ModelSpec(**{**GOOD, field: value})
    assert str(refused.value) == words


def test_a_good_spec_is_kept():
    assert ModelSpec(**GOOD).bytes_per_token == 2 * 2 * 1 * 8 * 2
