"""An attention scale or soft-cap of a magnitude fp32 cannot hold is refused by every backend's
input check: 1e39 made every output NaN on every backend, and a cap of 1e-46 was 0 (no cap) in
cpu-varlen while reference and sdpa applied it, so the backends silently disagreed."""
from __future__ import annotations

import pytest

from vmemkv.runtime.attention.checks import check_scalars
from vmemkv.runtime.attention.errors import AttentionShapeError


@pytest.mark.parametrize("scale, softcap, words", [
    (1e39, None, "scale must have a magnitude fp32 holds"),
    (-1e39, None, "scale must have a magnitude fp32 holds"),
    (1e-46, None, "scale must have a magnitude fp32 holds"),
    (0.125, 1e39, "a layer's logit softcap must have a magnitude fp32 holds"),
    (0.125, 1e-46, "a layer's logit softcap must have a magnitude fp32 holds"),
])
def test_a_magnitude_fp32_cannot_hold_is_refused(scale, softcap, words):
    with pytest.raises(AttentionShapeError, match=words):
        check_scalars(scale, softcap)


def test_usual_values_pass():
    check_scalars(0.125, None)
    check_scalars(-0.088, 50.0)
    check_scalars(1e-30, 1e30)
