"""No CPU backend reads past a request's context_len: the memory there is really PROT_NONE.

A stray read faults (SIGSEGV), so the check runs in a child process and a crash is a failure
with a clear message instead of taking pytest down.

    vmem  k_cache [slots=4, ctx=128 tokens, 2 heads, 16] fp32: 128 B/token, 32 tokens/4 KiB page
          slot 2: tokens 0..63 mapped (two pages), 64..127 PROT_NONE; other slots all PROT_NONE
    paged pool [8 blocks, 32 tokens, ...]: one page per block; only the request's blocks mapped,
          padding table entries name an unmapped block
    windowed layers (window 40, ctx 100, 1-8 queries: kv_start 53-60): the page before the
          window (tokens 0..31) is PROT_NONE too, vmem and paged (its table entry: unmapped)
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import ctypes, mmap, math, torch
    from vmemkv.runtime.attention import PagedLayerView, VMemLayerView, get_backend
    from vmemkv.runtime.attention.reference import dense_attention
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE = mmap.PAGESIZE
    BACKENDS = [get_backend("reference"), get_backend("sdpa"), get_backend("cpu-varlen"),
                get_backend("cpu-varlen", sdpa_above_tokens=2),   # chunks over 2 tokens: SDPA
                get_backend("cpu-varlen", sdpa_above_tokens=None, work_units=4, split_min_keys=8)]  # 4 splits
    assert PAGE == 4096, PAGE

    def region(shape):
        n = math.prod(shape) * 4
        mm = mmap.mmap(-1, n)
        t = torch.frombuffer(mm, dtype=torch.float32).view(*shape)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        return mm, t, addr

    def protect(addr, nbytes):
        assert libc.mprotect(addr, nbytes, 0) == 0, ctypes.get_errno()   # PROT_NONE

    torch.manual_seed(0)
    ctx, slot = 64, 2
    q = torch.randn(3, 4, 16)                                 # up to 3 query rows, 4 heads
    kk, vv = torch.randn(ctx, 2, 16), torch.randn(ctx, 2, 16)
    want = {}
    for qlen in (1, 3):
        want[qlen] = dense_attention(q[:qlen], kk, vv, 0.25)

    # ---- vmem: only slot 2, tokens < 64 are mapped
    keep = []
    mk, k, ak = region((4, 128, 2, 16)); mv, v, av = region((4, 128, 2, 16))
    keep += [mk, mv]
    k[slot, :ctx], v[slot, :ctx] = kk, vv
    row = 128 * 128                                           # bytes per slot: 128 tokens x 128 B
    for a in (ak, av):
        protect(a, slot * row)                                  # slots 0, 1
        protect(a + slot * row + ctx * 128, 4 * row - slot * row - ctx * 128)   # tail + slot 3
    for backend in BACKENDS:
        for qlen in (1, 3):
            view = VMemLayerView(k, v, torch.tensor([slot]), torch.tensor([ctx]), torch.tensor([qlen]))
            out = backend.forward(q[:qlen], view, scale=0.25)
            torch.testing.assert_close(out, want[qlen], atol=1e-5, rtol=1e-5)

    # ---- paged: blocks 5 and 2 hold the request; everything else PROT_NONE
    mpk, pk, apk = region((8, 32, 2, 16)); mpv, pv, apv = region((8, 32, 2, 16))
    keep += [mpk, mpv]
    pk[5], pk[2] = kk[:32], kk[32:]
    pv[5], pv[2] = vv[:32], vv[32:]
    for a in (apk, apv):
        for b in range(8):
            if b not in (5, 2):
                protect(a + b * PAGE, PAGE)
    table = torch.tensor([[5, 2, 7, 7]], dtype=torch.int32)    # padding -> unmapped block 7
    for backend in BACKENDS:
        for qlen in (1, 3):
            view = PagedLayerView(pk, pv, table, torch.tensor([ctx]), torch.tensor([qlen]))
            out = backend.forward(q[:qlen], view, scale=0.25)
            torch.testing.assert_close(out, want[qlen], atol=1e-5, rtol=1e-5)

    # ---- windowed layers, prefill chunks included: page 0 (tokens 0..31) lies behind every window
    ctx, window = 100, 40
    qw, kw, vw = torch.randn(8, 4, 16), torch.randn(ctx, 2, 16), torch.randn(ctx, 2, 16)
    mk, k, ak = region((1, 128, 2, 16)); mv, v, av = region((1, 128, 2, 16)); keep += [mk, mv]
    k[0, :ctx], v[0, :ctx] = kw, vw
    for a in (ak, av):
        protect(a, PAGE)
    mpk, pk, apk = region((8, 32, 2, 16)); mpv, pv, apv = region((8, 32, 2, 16)); keep += [mpk, mpv]
    for j, b in enumerate((5, 2, 3)):                         # tokens 32.., 64.., 96..99
        pk[b][:min(32, ctx - 32 * (j + 1))] = kw[32 * (j + 1):32 * (j + 2)]
        pv[b][:min(32, ctx - 32 * (j + 1))] = vw[32 * (j + 1):32 * (j + 2)]
    for a in (apk, apv):
        for b in (0, 1, 4, 6, 7):
            protect(a + b * PAGE, PAGE)
    table = torch.tensor([[7, 5, 2, 3]], dtype=torch.int32)   # block of tokens 0..31: unmapped
    for backend in BACKENDS:
        for qlen in (1, 3, 8):
            want_w = dense_attention(qw[:qlen], kw, vw, 0.25, window=window)
            lens = (torch.tensor([ctx]), torch.tensor([qlen]))
            for view in (VMemLayerView(k, v, torch.tensor([0]), *lens, window=window),
                         PagedLayerView(pk, pv, table, *lens, window=window)):
                out = backend.forward(qw[:qlen], view, scale=0.25)
                torch.testing.assert_close(out, want_w, atol=1e-5, rtol=1e-5)
    print("OK")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses Linux mprotect")
def test_no_cpu_backend_reads_unmapped_memory_past_context_len():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, (
        f"child exited {proc.returncode} (-11 = SIGSEGV: a backend read unmapped memory)\n"
        f"{proc.stdout}\\n{proc.stderr[-3000:]}")
