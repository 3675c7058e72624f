"""cpu-varlen's logit soft-cap (``cap * tanh(score / cap)``) holds the documented 1e-5 against
the dense fp32 reference at every cap, not only at caps near the scores (Gemma's 30 or 50).

Its tanh was ``(1 - e) / (1 + e)`` with ``e = exp(-2|y|)``, whose absolute error ~2^-23 makes
the capped score's error ~cap * 2^-23 where ``|score / cap|`` is small: 1.7e-2 in the outputs at
cap 1e6, and at cap 1e30 every score became 0 (a uniform average of V) while the reference (and
``sdpa``) gave the uncapped attention.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vmemkv.runtime.attention import availability, get_backend
from tests.runtime.test_attention_backends import make_case
from tests.runtime.test_attention_native_prefill import layer_view

pytestmark = pytest.mark.skipif(not availability("cpu-varlen"),
                                reason=f"cpu-varlen unavailable: {availability('cpu-varlen').reason}")


@pytest.mark.parametrize("layout", ["vmem", "paged"])
@pytest.mark.parametrize("softcap", [50.0, 1e3, 1e6, 1e30])
def test_soft_capped_scores_match_the_reference_at_every_cap(layout, softcap):
    # a prefill chunk (GEMM-like units: 9 rows of a KV head) beside decodes, one of them split
    case = make_case([(9, 9), (300, 1), (5, 1)], heads=4, kv_heads=2, head_dim=64)
    view = dataclasses.replace(layer_view(case, layout, [0, 0, 0], None), softcap=softcap)
    scale = 1 / math.sqrt(64)
    kernel = get_backend("cpu-varlen", sdpa_above_tokens=None, work_units=2, split_min_keys=1)
    out = kernel.forward(case.q, view, scale)
    expected = get_backend("reference").forward(case.q, view, scale)
    assert (out - expected).abs().max().item() < 1e-5


def test_a_huge_cap_is_no_cap():
    case = make_case([(9, 9), (40, 1)], heads=4, kv_heads=2, head_dim=32)
    view = layer_view(case, "vmem", [0, 0], None)
    scale = 1 / math.sqrt(32)
    kernel = get_backend("cpu-varlen", sdpa_above_tokens=None)
    capped = kernel.forward(case.q, dataclasses.replace(view, softcap=1e30), scale)
    assert (capped - kernel.forward(case.q, view, scale)).abs().max().item() < 1e-5
