"""``flash`` on the interleaved vmem layout: the layer's strided view goes to FlashAttention as it
is, in one call for the batch (no per-request fallback, no copy), and the result is exact.

The interleaved cache is ``[B, C, layers, Hkv, D]``; a layer's view ``k_all[:, :, l]`` has token
rows ``layers x Hkv x D`` elements apart, which flattens to packed sequences
``[B * C, Hkv, D]`` with that row stride (FA2 takes any row stride with a contiguous head dim).
GPU only (FA2 is CUDA-only); on a CPU machine the test skips.
"""
from __future__ import annotations

import math

import pytest
import torch

from vmemkv.runtime.attention import availability
from vmemkv.runtime.attention.flash import FlashBackend
from tests.runtime.test_attention_backends import SPECS, make_case, truth, vmem_view

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]


@pytest.mark.parametrize("kind", ["decode", "prefill_after_prefix", "mixed"])
def test_flash_hands_the_interleaved_layers_strided_view_to_one_flash_call(kind, monkeypatch):
    if not availability("flash"):
        pytest.skip(availability("flash").reason)
    case = make_case(SPECS[kind], heads=8, kv_heads=2, head_dim=64, dtype=torch.float16,
                     device="cuda", seed=4)
    view = vmem_view(case, interleaved=True)            # 3 layers, layer 1 timed: strided
    row_stride = view.k_cache.stride(1)
    assert row_stride == 3 * 2 * 64 != view.k_cache.shape[2] * view.k_cache.shape[3]
    backend, calls = FlashBackend(), []
    kernel, why = backend._one_call_kernel(case.q, view.kv_heads)
    assert kernel is not None, f"no one-call FA2 kernel on this torch: {why}"

    def spy(q, k, v, *args, **kwargs):
        calls.append((k.data_ptr(), k.stride(), v.data_ptr(), v.stride()))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(backend, "_one_call_kernel", lambda q, kv_heads: (spy, ""))
    out = backend.forward(case.q, view)
    assert len(calls) == 1, "one FlashAttention call for the whole batch"
    k_ptr, k_stride, v_ptr, v_stride = calls[0]
    assert (k_ptr, v_ptr) == (view.k_cache.data_ptr(), view.v_cache.data_ptr()), "no copy"
    assert k_stride[0] == v_stride[0] == row_stride and k_stride[1:] == (64, 1)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), truth(case), atol=2e-2, rtol=2e-2)
    assert math.isfinite(float(out.float().abs().max()))
