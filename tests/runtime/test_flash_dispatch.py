"""The ``flash`` backend's batched decode on both layouts, on the CPU: which kernel it picks, and
the packed-sequence arguments it builds for it (vmem: the cache itself, sorted by slot; paged:
one gather of the batch's blocks).

FA2 itself runs only on CUDA (tests/runtime/test_attention_backends.py covers it on a GPU).
Here a CPU stand-in with the kernel's documented varlen semantics -- sequence i's keys are
``k[cu_seq_k[i] : cu_seq_k[i] + seqused_k[i]]`` -- receives exactly what the backend would hand
FA2. The caches are NaN everywhere a request does not own, so a wrong offset, length or slot
order reads NaN or another request's keys and fails the comparison with dense attention.
"""
import math

import pytest
import torch

from runtime.attention import flash
from runtime.attention.flash import FlashBackend, VarlenCaps
from runtime.attention.reference import dense_attention

from .test_attention_backends import SPECS, make_case, paged_view, truth, vmem_view


class KernelCalls:
    """A stand-in for the FA2 varlen kernel that checks its arguments and records each call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_k, scale, used):
        self.calls += 1
        assert cu_q.dtype == cu_k.dtype == used.dtype == torch.int32
        assert k.dim() == 3 and q.shape[1] % k.shape[1] == 0
        starts, ends = cu_k[:-1].tolist(), cu_k[1:].tolist()
        assert starts == sorted(starts), "cu_seq_k must be monotone"
        assert all(u <= e - s for s, e, u in zip(starts, ends, used.tolist())), "seqused_k past its segment"
        assert max_k == max(used.tolist()) and int(cu_k[-1]) <= k.shape[0]
        group = q.shape[1] // k.shape[1]
        rows = []
        for i, (start, n) in enumerate(zip(starts, used.tolist())):
            keys = k[start:start + n].repeat_interleave(group, dim=1).float()
            values = v[start:start + n].repeat_interleave(group, dim=1).float()
            rows.append(dense_attention(q[cu_q[i]:cu_q[i + 1]].float(), keys, values, scale))
        return torch.cat(rows).to(q.dtype)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(flash, "_warned", set())


def decode_case(interleaved=False, heads=8, kv_heads=2, seed=0):
    spec = [(9, 1), (40, 1), (1, 1), (33, 1), (17, 1)]
    case = make_case(spec, heads=heads, kv_heads=kv_heads, head_dim=16, seed=seed)
    return case, vmem_view(case, interleaved=interleaved, spare_slots=3, seed=seed + 1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["per-layer", "interleaved"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_packed_decode_hands_the_kernel_each_requests_own_keys(interleaved, heads, kv_heads):
    case, view = decode_case(interleaved, heads, kv_heads)
    kernel = KernelCalls()
    out = FlashBackend()._packed_decode(case.q, view, 1 / math.sqrt(16), kernel)
    assert kernel.calls == 1                      # one call for the whole batch
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


def test_without_varlen_seqused_k_decode_goes_to_the_aten_kernel_once_per_layer(
        monkeypatch, fresh_warnings):
    monkeypatch.setattr(flash, "varlen_caps", lambda: VarlenCaps(None, frozenset(), "no varlen here"))
    monkeypatch.setattr(flash, "aten_flash_args", lambda: frozenset({"seqused_k", "scale"}))
    kernel = KernelCalls()
    monkeypatch.setattr(FlashBackend, "_aten_kernel", staticmethod(kernel))
    case, view = decode_case()
    with pytest.warns(RuntimeWarning, match=r"aten\._flash_attention_forward\(seqused_k=\).*no varlen here"):
        out = FlashBackend()._forward_vmem(case.q, view, 0.25)
    FlashBackend()._forward_vmem(case.q, view, 0.25)     # said once, not per call
    assert kernel.calls == 2
    expected = torch.cat([dense_attention(case.q[i:i + 1], k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), 0.25)
                          for i, (k, v) in enumerate(zip(case.keys, case.values))])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_varlen_with_seqused_k_is_preferred_over_the_aten_kernel(monkeypatch, fresh_warnings):
    varlen, aten = KernelCalls(), KernelCalls()
    monkeypatch.setattr(flash, "varlen_caps",
                        lambda: VarlenCaps(object(), frozenset({"seqused_k", "enable_gqa", "scale"})))
    monkeypatch.setattr(FlashBackend, "_varlen_kernel", staticmethod(varlen))
    monkeypatch.setattr(FlashBackend, "_aten_kernel", staticmethod(aten))
    case, view = decode_case()
    FlashBackend()._forward_vmem(case.q, view, 0.25)
    assert (varlen.calls, aten.calls) == (1, 0)


def test_with_neither_kernel_decode_runs_per_request_and_says_why(monkeypatch, fresh_warnings):
    monkeypatch.setattr(flash, "varlen_caps", lambda: VarlenCaps(None, frozenset(), "no varlen here"))
    monkeypatch.setattr(flash, "aten_flash_args", lambda: frozenset())
    case, view = decode_case()
    with pytest.warns(RuntimeWarning, match="one SDPA-flash call per request: no varlen here; .*seqused_k"):
        out = FlashBackend()._forward_vmem(case.q, view, 1 / math.sqrt(16))
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


def test_prefill_never_takes_the_packed_decode_path(monkeypatch, fresh_warnings):
    kernel = KernelCalls()
    monkeypatch.setattr(FlashBackend, "_aten_kernel", staticmethod(kernel))
    monkeypatch.setattr(FlashBackend, "_varlen_kernel", staticmethod(kernel))
    case = make_case(SPECS["mixed"])
    out = FlashBackend()._forward_vmem(case.q, vmem_view(case), 1 / math.sqrt(16))
    assert kernel.calls == 0
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


def test_this_torch_reports_the_aten_kernel_arguments():
    """The schema is readable without CUDA; torch >= 2.5 has seqused_k on the op."""
    args = flash.aten_flash_args()
    assert {"query", "key", "value", "cum_seq_q", "cum_seq_k", "seqused_k", "scale"} <= args


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_paged_decode_gathers_once_and_hands_the_kernel_each_requests_keys(block_size, heads, kv_heads):
    case = make_case([(9, 1), (40, 1), (1, 1), (33, 1), (17, 1)], heads=heads, kv_heads=kv_heads,
                     head_dim=16, seed=4)
    kernel = KernelCalls()
    view = paged_view(case, block_size=block_size)
    out = FlashBackend()._gathered_decode(case.q, view, 1 / math.sqrt(16), kernel)
    assert kernel.calls == 1 and not torch.isnan(out).any()
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # which path: asserted above
@pytest.mark.parametrize("mode", ["auto", "gather"])
def test_paged_decode_without_a_block_table_takes_the_one_call_gather(monkeypatch, fresh_warnings, mode):
    monkeypatch.setattr(flash, "varlen_caps", lambda: VarlenCaps(None, frozenset(), "no varlen here"))
    monkeypatch.setattr(flash, "aten_flash_args", lambda: frozenset({"seqused_k"}))
    kernel = KernelCalls()
    monkeypatch.setattr(FlashBackend, "_aten_kernel", staticmethod(kernel))
    case = make_case(SPECS["decode"], seed=2)
    out = FlashBackend(paged_mode=mode)._forward_paged(case.q, paged_view(case), 1 / math.sqrt(16))
    assert kernel.calls == 1
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)
    prefill = make_case(SPECS["prefill_after_prefix"], seed=2)        # prefill: per request
    out = FlashBackend(paged_mode=mode)._forward_paged(prefill.q, paged_view(prefill), 1 / math.sqrt(16))
    assert kernel.calls == 1
    torch.testing.assert_close(out, truth(prefill), atol=1e-5, rtol=1e-5)
