"""The ``flash`` backend's one-call path on both layouts, on the CPU: which kernel it picks, and
the packed-sequence arguments it builds for it (vmem: the cache itself, requests sorted by slot;
paged: one gather of the batch's blocks).

FA2 itself runs only on CUDA (tests/runtime/test_attention_backends.py covers it on a GPU).
Here a CPU stand-in with the kernel's documented varlen semantics -- sequence i's queries are
``q[cu_seq_q[i] : cu_seq_q[i+1]]``, its keys ``k[cu_seq_k[i] : cu_seq_k[i] + seqused_k[i]]``,
causal masking bottom-right aligned -- receives exactly what the backend would hand FA2. The
caches are NaN everywhere a request does not own, so a wrong offset, length, row order or slot
reads NaN or another request's keys and fails the comparison with dense attention.
"""
import math

import pytest
import torch

from vmemkv.runtime.attention import flash
from vmemkv.runtime.attention.flash import FlashBackend, VarlenCaps
from vmemkv.runtime.attention.reference import dense_attention

from .test_attention_backends import SPECS, make_case, paged_view, truth, vmem_view

SCALE = 1 / math.sqrt(16)


class KernelStandIn:
    """FA2's varlen forward on the CPU (dense math), checking its arguments; counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, used, causal):
        self.calls += 1
        assert cu_q.dtype == cu_k.dtype == used.dtype == torch.int32
        assert k.dim() == 3 and q.shape[1] % k.shape[1] == 0
        q_bounds, k_starts, k_ends = cu_q.tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()
        lengths = used.tolist()
        assert q_bounds[0] == 0 and q_bounds[-1] == q.shape[0] and q_bounds == sorted(q_bounds)
        assert k_starts == sorted(k_starts), "cu_seq_k must be monotone"
        assert all(u <= e - s for s, e, u in zip(k_starts, k_ends, lengths)), "seqused_k past its segment"
        assert int(cu_k[-1]) <= k.shape[0]
        query_lens = [b - a for a, b in zip(q_bounds, q_bounds[1:])]
        assert max_q == max(query_lens) and max_k == max(lengths)
        assert causal or max_q == 1, "only a decode batch may skip the causal mask"
        rows = []
        for i, (start, n) in enumerate(zip(k_starts, lengths)):
            rows.append(dense_attention(q[q_bounds[i]:q_bounds[i + 1]].float(), k[start:start + n],
                                        v[start:start + n], scale))   # bottom-right causal
        return torch.cat(rows).to(q.dtype)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(flash, "_warned", set())


@pytest.fixture
def aten_only(monkeypatch, fresh_warnings):
    """A torch whose varlen_attn lacks seqused_k (2.10, 2.11) but whose operator has it."""
    monkeypatch.setattr(flash, "varlen_caps", lambda: VarlenCaps(None, frozenset(), "no varlen here"))
    monkeypatch.setattr(flash, "aten_flash_args", lambda: frozenset({"seqused_k", "scale"}))
    kernel = KernelStandIn()
    monkeypatch.setattr(FlashBackend, "_aten_kernel", staticmethod(kernel))
    return kernel


CASES = dict(SPECS, decode_wide=[(9, 1), (40, 1), (1, 1), (33, 1), (17, 1)])


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("interleaved", [False, True], ids=["per-layer", "interleaved"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_vmem_one_call_hands_the_kernel_each_requests_own_rows_and_keys(kind, interleaved, heads, kv_heads):
    case = make_case(CASES[kind], heads=heads, kv_heads=kv_heads, seed=1)
    view = vmem_view(case, interleaved=interleaved, spare_slots=3, seed=2)
    kernel = KernelStandIn()
    out = FlashBackend()._packed_call(case.q, view, SCALE, kernel)
    assert kernel.calls == 1 and not torch.isnan(out).any()
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


def test_vmem_one_call_when_requests_already_come_in_slot_order():
    case = make_case(SPECS["mixed"], seed=3)
    view = vmem_view(case)
    ordered = type(view)(view.k_cache, view.v_cache, torch.arange(len(case.keys)), view.context_lens,
                         view.query_lens)
    for i, slot in enumerate(range(len(case.keys))):          # move each request to slot i
        c = case.context_lens[i]
        ordered.k_cache[slot].fill_(math.nan), ordered.v_cache[slot].fill_(math.nan)
        ordered.k_cache[slot, :c], ordered.v_cache[slot, :c] = case.keys[i], case.values[i]
    out = FlashBackend()._packed_call(case.q, ordered, SCALE, KernelStandIn())
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_paged_one_call_gathers_once_and_hands_the_kernel_each_requests_keys(kind, block_size, heads, kv_heads):
    case = make_case(CASES[kind], heads=heads, kv_heads=kv_heads, seed=4)
    kernel = KernelStandIn()
    out = FlashBackend()._gathered_call(case.q, paged_view(case, block_size=block_size), SCALE, kernel)
    assert kernel.calls == 1 and not torch.isnan(out).any()
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


def test_without_varlen_seqused_k_both_layouts_go_to_the_aten_kernel(aten_only):
    case = make_case(SPECS["mixed"], heads=8, kv_heads=2, seed=5)
    with pytest.warns(RuntimeWarning, match=r"aten\._flash_attention_forward\(seqused_k=\).*no varlen here"):
        out = FlashBackend()._forward_vmem(case.q, vmem_view(case), SCALE)
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)
    FlashBackend()._forward_vmem(case.q, vmem_view(case), SCALE)       # said once, not per call
    with pytest.warns(RuntimeWarning, match="gathers the batch's blocks in one copy"):
        out = FlashBackend()._forward_paged(case.q, paged_view(case), SCALE)
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)
    assert aten_only.calls == 3
    FlashBackend(paged_mode="gather")._forward_paged(case.q, paged_view(case), SCALE)
    assert aten_only.calls == 4                                        # "gather" gathers once too


def test_varlen_with_seqused_k_is_preferred_over_the_aten_kernel(monkeypatch, fresh_warnings):
    varlen, aten = KernelStandIn(), KernelStandIn()
    monkeypatch.setattr(flash, "varlen_caps",
                        lambda: VarlenCaps(object(), frozenset({"seqused_k", "enable_gqa", "scale"})))
    monkeypatch.setattr(FlashBackend, "_varlen_kernel", staticmethod(varlen))
    monkeypatch.setattr(FlashBackend, "_aten_kernel", staticmethod(aten))
    case = make_case(SPECS["decode"])
    FlashBackend()._forward_vmem(case.q, vmem_view(case), SCALE)
    assert (varlen.calls, aten.calls) == (1, 0)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_with_neither_kernel_attention_runs_per_request_and_says_why(monkeypatch, fresh_warnings, kind):
    monkeypatch.setattr(flash, "varlen_caps", lambda: VarlenCaps(None, frozenset(), "no varlen here"))
    monkeypatch.setattr(flash, "aten_flash_args", lambda: frozenset())
    case = make_case(SPECS[kind])
    with pytest.warns(RuntimeWarning, match="one SDPA-flash call per request: no varlen here; .*seqused_k"):
        out = FlashBackend()._forward_vmem(case.q, vmem_view(case), SCALE)
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)
    with pytest.warns(RuntimeWarning, match="gathers blocks per request: .*no varlen here"):
        out = FlashBackend()._forward_paged(case.q, paged_view(case), SCALE)
    torch.testing.assert_close(out, truth(case), atol=1e-5, rtol=1e-5)


def test_this_torch_reports_the_aten_kernel_arguments():
    """The schema is readable without CUDA; torch >= 2.5 has seqused_k on the op."""
    args = flash.aten_flash_args()
    assert {"query", "key", "value", "cum_seq_q", "cum_seq_k", "seqused_k", "scale", "is_causal"} <= args
