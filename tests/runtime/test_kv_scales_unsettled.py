"""8-bit first-write scales and the writes that fix them: a layer a write fixed stays
"unsettled" until the engine's step commits (``settle``), and ``unfix_unsettled`` (a step rolled
back, a lone run of one request) unfixes exactly those layers, so a failed request's K/V fix
nobody's scales; K/V holding +-inf are refused like NaN (int8/fp8 clamped inf to their max and
a first write's inf gave the head scale 1.0), before anything is fixed."""
from __future__ import annotations

import re

import pytest
import torch

from vmemkv.runtime.errors import NonFiniteKVError
from vmemkv.runtime.kv_dtype import KVScales, ScaleTable, first_write_scales, kv_encoding


def table(name="int8", given=None) -> ScaleTable:
    return ScaleTable(kv_encoding(name, torch.float32), 3, 2, torch.device("cpu"), given)


def kv(amax_0: float, amax_1: float) -> torch.Tensor:
    """[tokens 2, kv_heads 2, head_dim 4] whose per-head amax is (amax_0, amax_1)."""
    x = torch.zeros(2, 2, 4)
    x[1, 0, 2], x[0, 1, 3] = -amax_0, amax_1
    return x


def test_unfix_unsettled_unfixes_only_the_layers_fixed_since_settle():
    scales = table()
    scales.encode(0, kv(12.7, 25.4), kv(1.27, 2.54))
    scales.settle()                                        # layer 0's write was kept
    scales.encode(2, kv(127.0, 254.0), kv(127.0, 254.0))   # layer 2's was not
    assert scales.unsettled == [2] and scales.fixed == [True, False, True]
    assert scales.unfix_unsettled() == [2]
    assert scales.fixed == [True, False, False] and scales.unsettled == []
    assert scales.k[0].tolist() == pytest.approx([0.1, 0.2])
    assert scales.v[0].tolist() == pytest.approx([0.01, 0.02])
    assert scales.k[2].tolist() == [1.0, 1.0] and scales.v[2].tolist() == [1.0, 1.0]
    scales.encode(2, kv(1.27, 1.27), kv(2.54, 2.54))       # the next write fixes them anew
    assert scales.k[2].tolist() == pytest.approx([0.01, 0.01]) and scales.unsettled == [2]


def test_given_scales_are_never_unsettled():
    given = KVScales.of([[0.5, 0.25]] * 3, [[1.0, 2.0]] * 3)
    scales = table(given=given)
    scales.encode(1, kv(1.0, 1.0), kv(1.0, 1.0))
    assert scales.unsettled == [] and scales.unfix_unsettled() == []
    assert scales.fixed == [True] * 3 and scales.v[1].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("bad, what", [(float("inf"), "+-inf"), (float("-inf"), "+-inf"),
                                       (float("nan"), "NaN")])
def test_non_finite_kv_is_refused_before_anything_is_fixed(name, bad, what):
    scales = table(name)
    v = kv(1.0, 2.0)
    v[0, 1, 0] = bad
    with pytest.raises(NonFiniteKVError, match=re.escape(f"layer 1's V holds {what}")):
        scales.encode(1, kv(1.0, 2.0), v)
    assert scales.fixed == [False] * 3 and scales.unsettled == []
    assert scales.k[1].tolist() == [1.0, 1.0] and scales.v[1].tolist() == [1.0, 1.0]


def test_first_write_scales_refuse_a_non_finite_amax_and_give_1_where_it_is_0():
    enc = kv_encoding("int8", torch.float32)
    assert first_write_scales(kv(0.0, 12.7), enc).tolist() == pytest.approx([1.0, 0.1])
    x = kv(1.0, 1.0)
    x[0, 0, 0] = float("inf")        # it gave head 0 the scale 1.0
    with pytest.raises(NonFiniteKVError, match="NaN or \\+-inf"):
        first_write_scales(x, enc)
