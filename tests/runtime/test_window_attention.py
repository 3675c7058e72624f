"""Sliding-window and soft-capped layers on every CPU backend, both layouts, and the ``flash``
backend's window packing (CPU stand-in kernel, as tests/runtime/test_flash_dispatch.py does).

The truth is dense fp32 attention over ALL of a request's keys with transformers' window mask
(a query at p sees keys (p - window, p], ``kv_idx > q_idx - window``). The caches are NaN
wherever a backend must not read, now including the keys before each request's ``kv_start``
(vmem) and the blocks wholly before ``kv_start // block_size`` (paged, whose table entries
there name the NaN block): a backend that reads behind the window returns NaN.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vmemkv.runtime.attention import get_backend
from vmemkv.runtime.attention.views import window_starts, BatchLens
from vmemkv.runtime.attention.errors import AttentionShapeError, UnsupportedError
from vmemkv.runtime.attention.flash import FlashBackend, VarlenCaps, call_varlen
from vmemkv.runtime.attention.reference import dense_attention

from ..vmem_only_options import options_for
from .test_attention_backends import NAN_PADDING_BLOCK, make_case, paged_view, vmem_view

SPECS = {
    "decode": [(9, 1), (17, 1), (1, 1), (33, 1)],
    "prefill_fresh": [(12, 12), (7, 7), (30, 30)],
    "prefill_after_prefix": [(20, 6), (13, 5), (40, 9)],
    "mixed": [(21, 1), (15, 15), (30, 7), (5, 1), (11, 3)],
}
WINDOWS = [1, 4, 7, 64]


def truth(case, window=None, softcap=None):
    scale, outs, start = 1.0 / math.sqrt(case.q.shape[-1]), [], 0
    for k, v, n in zip(case.keys, case.values, case.query_lens):
        outs.append(dense_attention(case.q[start:start + n].float(), k.float(), v.float(), scale,
                                    window=window, softcap=softcap))
        start += n
    return torch.cat(outs)


def windowed_vmem_view(case, window, interleaved=False):
    view = vmem_view(case, interleaved=interleaved)
    view = type(view)(view.k_cache, view.v_cache, view.slots, view.context_lens, view.query_lens,
                      window=window)
    for i, slot in enumerate(view.host_slots):      # the keys behind the window: poisoned
        view.k_cache[slot, :view.kv_starts[i]] = math.nan
        view.v_cache[slot, :view.kv_starts[i]] = math.nan
    return view


def windowed_paged_view(case, window, block_size=4):
    view = paged_view(case, block_size=block_size)
    view = type(view)(view.k_pool, view.v_pool, view.block_tables, view.context_lens,
                      view.query_lens, window=window)
    for i in range(len(case.keys)):    # blocks wholly behind the window: freed (the NaN block)
        view.block_tables[i, :view.first_block_of(i)] = NAN_PADDING_BLOCK
    return view


def build(case, layout, window):
    if layout == "paged":
        return windowed_paged_view(case, window)
    return windowed_vmem_view(case, window, interleaved=layout == "vmem-interleaved")


def test_window_starts_follow_the_earliest_query_of_each_request():
    lens = BatchLens((10, 10, 3, 12), (1, 4, 3, 12), (0, 1, 5, 8))
    assert window_starts(lens, 4) == (6, 3, 0, 0)
    assert window_starts(lens, None) == (0, 0, 0, 0)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("layout", ["vmem", "vmem-interleaved", "paged"])
@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_backend_matches_dense_window_and_never_reads_behind_it(backend, layout, kind, window):
    case = make_case(SPECS[kind], seed=window)
    out = get_backend(backend).forward(case.q, build(case, layout, window))
    assert not torch.isnan(out).any(), "a key behind the window (or past the context) was read"
    torch.testing.assert_close(out, truth(case, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("layout", ["vmem", "paged"])
@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_layers_match_dense_softcap(backend, layout, window):
    case = make_case(SPECS["mixed"], seed=11)
    case.q.mul_(4)                                   # scores large enough for the cap to bite
    view = build(case, layout, window) if window else \
        (paged_view(case) if layout == "paged" else vmem_view(case))
    out = get_backend(backend).forward(case.q, view, softcap=2.0)
    want = truth(case, window, softcap=2.0)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, truth(case, window), atol=1e-3), "the cap changed nothing"


def test_a_window_that_covers_every_key_equals_full_attention():
    case = make_case(SPECS["mixed"], seed=2)
    full = get_backend("sdpa").forward(case.q, vmem_view(case))
    wide = get_backend("sdpa").forward(case.q, windowed_vmem_view(case, 64))
    torch.testing.assert_close(wide, full)


def test_bad_window_or_softcap_on_a_view_is_a_typed_error():
    case = make_case(SPECS["decode"])
    view = vmem_view(case)
    for window in (0, -3, True, 2.5):
        bad = type(view)(view.k_cache, view.v_cache, view.slots, view.context_lens,
                         view.query_lens, window=window)
        with pytest.raises(AttentionShapeError, match="sliding window must be an int >= 1"):
            get_backend("sdpa").forward(case.q, bad)
    with pytest.raises(AttentionShapeError, match="softcap must be finite and > 0"):
        get_backend("sdpa").forward(case.q, view, softcap=-1.0)


def test_a_backend_without_windows_refuses_a_windowed_layer_by_name():
    from vmemkv.runtime.attention.flash_attn_pkg import FlashAttnBackend
    from vmemkv.runtime.attention.reference import ReferenceBackend

    class FullOnly(ReferenceBackend):     # what flash-attn declares, on a CPU backend
        name, layer_features = "full-only", FlashAttnBackend.layer_features
    case = make_case(SPECS["decode"])
    with pytest.raises(UnsupportedError, match=r"'full-only' does not implement \['window'\]"):
        FullOnly().forward(case.q, windowed_vmem_view(case, 4))
    with pytest.raises(UnsupportedError, match=r"does not implement \['softcap'\]"):
        FullOnly().forward(case.q, vmem_view(case), softcap=5.0)


# ---- flash: the window reaches FA2 as kv_start offsets plus window_size ------------------------
class WindowKernel:
    """FA2 varlen semantics on the CPU with ``window_size = (window - 1, 0)``: sequence i's keys
    ``k[cu_k[i] : cu_k[i] + seqused_k[i]]``, bottom-right causal, keys (p - window, p]."""

    def __init__(self):
        self.windows = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, used, causal, window=None):
        self.windows.append(window)
        qb, starts, lengths = cu_q.tolist(), cu_k[:-1].tolist(), used.tolist()
        assert starts == sorted(starts) and max_k == max(lengths)
        rows = [dense_attention(q[qb[i]:qb[i + 1]].float(), k[s:s + n], v[s:s + n], scale, window=window)
                for i, (s, n) in enumerate(zip(starts, lengths))]
        return torch.cat(rows).to(q.dtype)


FLASH_CALLS = {"vmem packed": (windowed_vmem_view, FlashBackend._packed_call),
               "paged gather": (windowed_paged_view, FlashBackend._gathered_call)}


@pytest.mark.parametrize("call", list(FLASH_CALLS))
@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("window", [1, 4, 7])
def test_flash_one_call_starts_each_request_at_its_window(call, kind, window):
    """vmem: cu_seq_k at slot * max_ctx + kv_start; paged: the gather from the first block of
    the window; both: seqused_k from there and FA2's window_size."""
    case = make_case(SPECS[kind], heads=8, kv_heads=2, seed=3)
    view_of, method = FLASH_CALLS[call]
    kernel = WindowKernel()
    out = method(FlashBackend(), case.q, view_of(case, window), 0.25, kernel)
    assert kernel.windows == [window] and not torch.isnan(out).any()
    torch.testing.assert_close(out, truth(case, window), atol=1e-5, rtol=1e-5)


def test_flash_block_table_rows_start_at_the_first_block_of_the_window(monkeypatch):
    """The paged block-table call: each row shifted to its first read block, seqused_k from there."""
    from vmemkv.runtime.attention import flash
    seen = {}

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.update(kw, max_k=max_k)
        return torch.zeros_like(q)

    monkeypatch.setattr(flash, "varlen_caps", lambda: VarlenCaps(fake_varlen, frozenset(
        {"seqused_k", "block_table", "enable_gqa", "scale", "window_size"})))
    case = make_case([(21, 1), (30, 7)], heads=8, kv_heads=2)
    view = windowed_paged_view(case, 4)
    FlashBackend()._varlen_paged(case.q, view, 0.25)
    firsts = [view.first_block_of(i) for i in range(2)]           # kv_starts 17, 20 -> blocks 4, 5
    assert firsts == [4, 5] and seen["window_size"] == (3, 0)
    assert seen["seqused_k"].tolist() == [21 - 16, 30 - 20] and seen["max_k"] == 10
    table = seen["block_table"].tolist()
    assert table[0][:2] == view.block_tables[0, 4:6].tolist()
    assert table[1][:3] == view.block_tables[1, 5:8].tolist()


def test_flash_softcapped_layers_run_per_request_on_the_capped_math(monkeypatch):
    from vmemkv.runtime.attention import flash
    monkeypatch.setattr(flash, "_warned", set())
    case = make_case(SPECS["mixed"], seed=6)
    view = windowed_vmem_view(case, 4)
    capped = type(view)(*_fields(view), window=4, softcap=3.0)
    with pytest.warns(RuntimeWarning, match="soft-cap"):
        out = FlashBackend()._forward_vmem(case.q, capped, 0.25)
    torch.testing.assert_close(out, truth(case, 4, softcap=3.0), atol=1e-5, rtol=1e-5)


def _fields(view):
    return view.k_cache, view.v_cache, view.slots, view.context_lens, view.query_lens


def test_call_varlen_spells_the_window_as_fa2_window_size():
    seen = {}
    caps = VarlenCaps(lambda *a, **kw: seen.update(kw), frozenset({"scale", "window_size"}))
    q = torch.zeros(2, 4, 16)
    call_varlen(caps, q, q, q, None, None, 1, 1, 0.25, causal=True, gqa=False, window=8)
    assert seen["window_size"] == (7, 0)
    with pytest.raises(UnsupportedError, match="no window_size argument"):
        call_varlen(VarlenCaps(lambda *a, **kw: None, frozenset({"scale", "is_causal"})),
                    q, q, q, None, None, 1, 1, 0.25, causal=True, gqa=False, window=8)


# ---- the read guard covers the window start: memory behind the window is really PROT_NONE ----
CHILD = textwrap.dedent("""
    import ctypes, mmap, math, torch
    from vmemkv.runtime.attention import PagedLayerView, VMemLayerView, get_backend
    from vmemkv.runtime.attention.reference import dense_attention
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert mmap.PAGESIZE == 4096
    def region(shape):
        mm = mmap.mmap(-1, math.prod(shape) * 4)
        return mm, torch.frombuffer(mm, dtype=torch.float32).view(*shape), \\
            ctypes.addressof(ctypes.c_char.from_buffer(mm))
    def protect(addr, nbytes):
        assert libc.mprotect(addr, nbytes, 0) == 0
    torch.manual_seed(0)
    ctx, window = 100, 40                  # 128 B/token: 32 tokens per 4 KiB page
    q, kk, vv = torch.randn(3, 4, 16), torch.randn(ctx, 2, 16), torch.randn(ctx, 2, 16)
    want = {n: dense_attention(q[:n], kk, vv, 0.25, window=window) for n in (1, 3)}
    keep = []
    # vmem, one slot of 128 tokens: page 0 (tokens 0..31) lies wholly behind every window
    mk, k, ak = region((1, 128, 2, 16)); mv, v, av = region((1, 128, 2, 16)); keep += [mk, mv]
    k[0, :ctx], v[0, :ctx] = kk, vv
    for a in (ak, av):
        protect(a, 4096)
    for name in ("reference", "sdpa"):
        for n in (1, 3):                   # kv_start 60 (decode), 58 (3 queries)
            view = VMemLayerView(k, v, torch.tensor([0]), torch.tensor([ctx]), torch.tensor([n]),
                                 window=window)
            torch.testing.assert_close(get_backend(name).forward(q[:n], view, scale=0.25), want[n])
    # paged, blocks of 32 tokens: the request's block 0 was freed (table entry -> unmapped 7)
    mpk, pk, apk = region((8, 32, 2, 16)); mpv, pv, apv = region((8, 32, 2, 16)); keep += [mpk, mpv]
    for j, b in enumerate((5, 2, 3)):
        pk[b][:min(32, ctx - 32 * (j + 1))] = kk[32 * (j + 1):32 * (j + 2)]
        pv[b][:min(32, ctx - 32 * (j + 1))] = vv[32 * (j + 1):32 * (j + 2)]
    for a in (apk, apv):
        for b in (0, 1, 4, 6, 7):
            protect(a + b * 4096, 4096)
    table = torch.tensor([[7, 5, 2, 3]], dtype=torch.int32)
    for name in ("reference", "sdpa"):
        for n in (1, 3):
            view = PagedLayerView(pk, pv, table, torch.tensor([ctx]), torch.tensor([n]), window=window)
            torch.testing.assert_close(get_backend(name).forward(q[:n], view, scale=0.25), want[n])
    print("OK")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses Linux mprotect")
def test_no_cpu_backend_reads_unmapped_memory_behind_the_window():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, (
        f"child exited {proc.returncode} (-11 = SIGSEGV: a backend read behind the window)\n"
        f"{proc.stdout}\n{proc.stderr[-3000:]}")


# ---- CacheConfig.layer_windows: what the caches hand each layer's view ----------------------
def test_cache_config_layer_windows_are_validated_and_name_the_layer():
    from vmemkv.runtime.config import CacheConfig
    from vmemkv.runtime.errors import CacheConfigError
    config = CacheConfig(3, 2, 16, layer_windows=(8, None, 8))
    assert [config.window_of(i) for i in range(3)] == [8, None, 8]
    assert CacheConfig(3, 2, 16, layer_windows=(None,) * 3).layer_windows == ()   # all full
    with pytest.raises(CacheConfigError, match=r"one entry per layer \(3\)"):
        CacheConfig(3, 2, 16, layer_windows=(8, 8))
    with pytest.raises(CacheConfigError, match=r"layer_windows\[1\] must be None or an int >= 1"):
        CacheConfig(3, 2, 16, layer_windows=(8, 0, None))


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_each_layer_view_carries_its_layers_window(kind):
    from vmemkv.runtime.config import CacheConfig
    from vmemkv.runtime.kv import make_kv
    config = CacheConfig(3, 2, 16, max_batch=2, max_context=64, layer_windows=(8, None, 4))  # 32 tok/page
    with make_kv(config, kind, block_size=4, **options_for(kind, page_bytes=4096)) as kv:
        kv.manager.allocate(0, 20)
        kv.execute(kv.manager.take_ops())
        kv.begin_step([(0, 19, 1)])
        assert [kv.layer_view(i).window for i in range(3)] == [8, None, 4]
        assert [kv.layer_view(i).kv_starts for i in range(3)] == [(12,), (0,), (16,)]


# ---- on a GPU: the real kernels (FA2's window_size, SDPA's masks) against the same truth -------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("layout", ["vmem", "paged"])
@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("window", [1, 4, 7])
def test_windowed_backend_on_cuda_matches_dense_window(backend, layout, kind, window):
    from vmemkv.runtime.attention import availability
    if not availability(backend):
        pytest.skip(availability(backend).reason)
    case = make_case(SPECS[kind], heads=8, kv_heads=2, dtype=torch.float16, device="cuda", seed=window)
    out = get_backend(backend).forward(case.q, build(case, layout, window))
    assert not torch.isnan(out).any(), "a key behind the window (or past the context) was read"
    torch.testing.assert_close(out.float(), truth(case, window), atol=2e-2, rtol=2e-2)
