"""Given 8-bit scales must be numbers: float() read a str ("0.5"), bytes (b"1") and a bool
(True, as 1.0) as scales, so a config file's quoted value or a flag passed where a number
belongs ran silently. They are refused naming the field; numbers of any kind (numpy's, a 0-d
tensor) are read as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv_dtype import KVScales


@pytest.mark.parametrize("value", ["0.5", b"1", True])
def test_a_scale_that_is_no_number_is_refused_naming_the_field(value):
    with pytest.raises(CacheConfigError, match=r"kv_scales\.v must be \[num_layers\]"):
        KVScales.of([[0.5]], [[value]])


def test_numbers_of_any_kind_are_read():
    scales = KVScales.of([[np.float32(0.5), 2]], [[torch.tensor(0.25), np.int64(4)]])
    assert scales == KVScales(((0.5, 2.0),), ((0.25, 4.0),))
