"""CacheConfig pinned at its limits: the largest value of each bounded field is taken, one more
refused by name; the window every layer attends within is the widest layer's."""
from __future__ import annotations

import pytest

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheConfigError

SMALL = dict(num_layers=3, num_kv_heads=1, head_dim=4, max_batch=1, max_context=64)


@pytest.mark.parametrize("field, upper", [("num_layers", 1024), ("num_kv_heads", 1024),
                                          ("head_dim", 1024), ("max_batch", 1 << 16),
                                          ("max_context", 1 << 24)])
def test_each_bounded_field_takes_its_upper_limit_and_refuses_one_more(field, upper):
    assert getattr(CacheConfig(**{**SMALL, field: upper}), field) == upper
    with pytest.raises(CacheConfigError, match=rf"CacheConfig.{field} must be an int in \[1, {upper}\]"):
        CacheConfig(**{**SMALL, field: upper + 1})


def test_the_window_all_layers_attend_within_is_the_widest_layers():
    config = CacheConfig(**{**SMALL, "layer_windows": (8, 32, 4)})
    assert config.window_tokens == 32
    assert [config.window_of(layer) for layer in range(3)] == [8, 32, 4]
    assert CacheConfig(**{**SMALL, "layer_windows": (8, None, 4)}).window_tokens is None
