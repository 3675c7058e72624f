"""Hunt 32 (attention backends): reference, sdpa and cpu-varlen (whole and with split key ranges)
against an fp64 truth on random batches (mixed prefill / decode / chunks, 1-token contexts,
contexts across block edges and at max_context, odd head sizes, GQA 1-8, fp32 / bf16 / fp16
queries, K/V in every cache dtype, windows, soft-caps, scales, magnitudes, explicit key starts,
non-contiguous queries) with every position a backend must not read poisoned; and what the
hunt found: a window wider than any context, and a K/V dtype no backend reads."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..hypothesis_budget import examples
from vmemkv.runtime.attention import (AttentionShapeError, BatchLens, PagedLayerView, StepMeta,
                                      UnsupportedError, VMemLayerView, availability, get_backend)
from vmemkv.runtime.kv_dtype import first_write_scales, kv_encoding

KV_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8",
            torch.bfloat16: "bf16", torch.float16: "fp16"}
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# |out - truth| / max|V|: fp32 arithmetic, or the output's rounding to bf16 / fp16
BASE_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def fp64_truth(q, k, v, scale, window, softcap):
    """softmax(softcap(q k^T scale), bottom-right causal, window) v in fp64 over keys k, v."""
    t, h, _ = q.shape
    s, hkv, _ = k.shape
    k, v = k.double().repeat_interleave(h // hkv, 1), v.double().repeat_interleave(h // hkv, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos, key = torch.arange(t).unsqueeze(1) + (s - t), torch.arange(s).unsqueeze(0)
    visible = (key <= pos) & ((key > pos - window) if window is not None else True)
    return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)


def build(c, g):
    """(q, view, per-request decoded K and V) of case ``c``; the cache holds poison (NaN; int8:
    127, the largest) in other slots and blocks, past each context and before its key start."""
    n, hkv, d, kvdt = len(c["ctxs"]), c["kv_heads"], c["head_dim"], c["kv_dtype"]
    keys = [torch.randn(x, hkv, d, generator=g) * c["mag"] for x in c["ctxs"]]
    vals = [torch.randn(x, hkv, d, generator=g) * c["mag"] for x in c["ctxs"]]
    width = d * 2 if c["strided_q"] else d
    q = (torch.randn(sum(c["qlens"]), hkv * c["group"], width, generator=g) * c["mag"]).to(c["dtype"])
    q = q[:, :, ::2] if c["strided_q"] else q
    enc = kv_encoding(KV_NAMES.get(kvdt, "auto"), torch.float32)
    ks = first_write_scales(torch.cat(keys), enc) if enc.scaled else None
    vs = first_write_scales(torch.cat(vals), enc) if enc.scaled else None
    sk, sv = [enc.quantize(x, ks).clone() for x in keys], [enc.quantize(x, vs).clone() for x in vals]
    dk = [enc.dequantize(x, ks).float().clone() for x in sk]
    dv = [enc.dequantize(x, vs).float().clone() for x in sv]
    poison = 127 if kvdt == torch.int8 else math.nan
    for i, first in enumerate(c["starts"]):
        sk[i][:first] = poison
        sv[i][:first] = poison
    lens = BatchLens(tuple(c["ctxs"]), tuple(c["qlens"]),
                     tuple([0, *torch.tensor(c["qlens"]).cumsum(0).tolist()][:n]), tuple(c["starts"]))
    tensors = torch.tensor(c["ctxs"]), torch.tensor(c["qlens"])
    extra = dict(window=c["window"], softcap=c["softcap"], k_scale=ks, v_scale=vs)
    if c["layout"] == "paged":
        bs = c["block"]
        nbs = [-(-x // bs) for x in c["ctxs"]]
        ids = torch.randperm(sum(nbs) + 2, generator=g).tolist()
        kp = torch.full((sum(nbs) + 2, bs, hkv, d), poison).to(kvdt)
        vp = kp.clone()
        table = torch.full((n, max(nbs) + 1), 10**6, dtype=torch.int32)
        for i in range(n):
            for b in range(nbs[i]):
                blk, lo, hi = ids.pop(), b * bs, min(c["ctxs"][i], (b + 1) * bs)
                table[i, b] = blk
                kp[blk, :hi - lo], vp[blk, :hi - lo] = sk[i][lo:hi], sv[i][lo:hi]
        view = PagedLayerView(kp, vp, table, *tensors, meta=StepMeta(lens), **extra)
        return q, view, dk, dv
    slots = torch.randperm(n + 1, generator=g)[:n]
    shape = (n + 1, max(c["ctxs"]) + c["spare"], 3, hkv, d)   # interleaved: layer 1 of 3
    kc = torch.full(shape, poison).to(kvdt)
    vc = kc.clone()
    kc, vc = (kc[:, :, 1], vc[:, :, 1]) if c["layout"] == "interleaved" else (kc[:, :, 0].contiguous(),
                                                                          vc[:, :, 0].contiguous())
    for i, s in enumerate(slots.tolist()):
        kc[s, :c["ctxs"][i]], vc[s, :c["ctxs"][i]] = sk[i], sv[i]
    return q, VMemLayerView(kc, vc, slots, *tensors, meta=StepMeta(lens), **extra), dk, dv


@st.composite
def cases(draw):
    block = draw(st.sampled_from([1, 4, 16]))
    ctxs, qlens, starts = [], [], []
    for _ in range(draw(st.integers(1, 3))):
        ctx = draw(st.sampled_from([1, 2, block, block + 1, 2 * block + 3, 40]))
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        ql = 1 if kind == "decode" else ctx if kind == "prefill" else draw(st.integers(1, ctx))
        ctxs.append(ctx), qlens.append(ql)
        starts.append(draw(st.sampled_from([0, 0, 0, ctx - ql])))
    pick = lambda *values: draw(st.sampled_from(values))   # noqa: E731
    return dict(ctxs=ctxs, qlens=qlens, starts=starts, block=block, kv_heads=pick(1, 2),
                group=pick(1, 2, 4, 8), head_dim=pick(8, 40, 64, 80), dtype=pick(*Q_DTYPES),
                kv_dtype=pick(None, torch.float32, *KV_NAMES),
                layout=pick("vmem", "interleaved", "paged"), window=pick(None, 1, block + 3, 1000),
                softcap=pick(None, 1e-3, 30.0, 1e30), scale=pick(None, -0.3, 3.0),
                mag=pick(1.0, 0.01, 30.0), strided_q=pick(False, True), spare=pick(0, 5),
                seed=draw(st.integers(0, 99)))


@pytest.mark.skipif(not availability("cpu-varlen"), reason="cpu-varlen unavailable")
@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_every_cpu_backend_matches_fp64_on_random_batches(c):
    c["kv_dtype"] = c["kv_dtype"] or c["dtype"]
    q, view, dk, dv = build(c, torch.Generator().manual_seed(c["seed"]))
    scale = 1 / math.sqrt(c["head_dim"]) if c["scale"] is None else c["scale"]
    want = torch.cat([fp64_truth(q[a:a + n], k[s:], v[s:], scale, c["window"], c["softcap"])
                      for a, n, s, k, v in zip(view.lens.q_starts, c["qlens"], c["starts"], dk, dv)])
    vmax = max(max(v.abs().max().item() for v in dv), 1e-30)
    # a bound on |score|, and on how far fp32 rounding may move one (a cap bounds a capped
    # score's move by 2 cap); out moves by <= 2 vmax per unit of score
    bound = q.float().abs().max().item() * max(k.abs().max().item() for k in dk) * abs(scale) \
        * c["head_dim"]
    for name, options in (("reference", {}), ("sdpa", {}), ("cpu-varlen", {}),
                          ("cpu-varlen", {"work_units": 4, "split_min_keys": 1})):
        out = get_backend(name, **options).forward(q, view, scale=c["scale"])
        assert out.dtype == q.dtype and out.shape == q.shape, name
        assert out.isfinite().all(), name
        moved = bound * 2.0**-21
        moved = min(moved, 2 * c["softcap"]) if c["softcap"] is not None else moved
        tol = BASE_TOL[c["dtype"]] + 2 * moved
        assert (out.double() - want).abs().max().item() / vmax <= tol, (name, options)


def _full_prefill_view(window):
    g = torch.Generator().manual_seed(32)
    kc, vc = torch.randn(2, 8, 1, 16, generator=g), torch.randn(2, 8, 1, 16, generator=g)
    q = torch.randn(8, 2, 16, generator=g)
    return q, VMemLayerView(kc, vc, torch.tensor([1]), torch.tensor([8]), torch.tensor([8]), window=window)


@pytest.mark.parametrize("window", [2**31 - 1, 2**63, 2**64 + 1, 2**64 + 3, 10**30],
                         ids=["2e31-1", "2e63", "2e64+1", "2e64+3", "1e30"])
@pytest.mark.parametrize("name", ["reference", "sdpa", "cpu-varlen"])
def test_a_window_wider_than_any_context_is_full_attention(name, window):
    # a window is any int >= 1: 2**64 + 1 reached cpu-varlen's int64 argument as 1 (each query
    # saw its own key only: error 2.3), and the reference's arange overflowed (OverflowError)
    q, view = _full_prefill_view(window)
    _, full = _full_prefill_view(None)
    want = get_backend("reference").forward(q, full)
    out = get_backend(name).forward(q, view)
    assert (out - want).abs().max().item() < 1e-5


def test_a_context_past_32_bit_key_positions_is_refused_by_name():
    kp = torch.zeros(1, 2**20, 1, 1)
    table = torch.zeros(1, 2**11 + 1, dtype=torch.int32)   # one block, named 2049 times
    ctx = torch.tensor([2**31 + 1])
    view = PagedLayerView(kp, kp, table, ctx, torch.tensor([1]))
    with pytest.raises(AttentionShapeError, match=r"context_lens \[2147483649\] exceed the "
                                                  r"2147483647 tokens a request may hold"):
        view.validate(torch.zeros(1, 1, 1))   # what forward runs first (old: then 8 GiB gathered)


@pytest.mark.parametrize("kv_dtype", [torch.float64, torch.uint8, torch.float8_e4m3fnuz],
                         ids=["float64", "uint8", "e4m3fnuz"])
@pytest.mark.parametrize("name", ["reference", "sdpa", "cpu-varlen"])
def test_a_kv_dtype_no_backend_reads_is_refused_without_naming_readers(name, kv_dtype):
    # was "reads K/V only in q's dtype ...; backends that read it: cpu-varlen, sdpa and
    # reference on the CPU", from cpu-varlen itself, for a dtype none of them reads
    kc = torch.zeros(1, 8, 1, 8).to(kv_dtype)
    view = VMemLayerView(kc, kc.clone(), torch.tensor([0]), torch.tensor([4]), torch.tensor([1]))
    with pytest.raises(UnsupportedError) as err:
        get_backend(name).forward(torch.zeros(1, 1, 8), view)
    assert str(err.value) == (
        f"attention backend {name!r} cannot read a cache of {kv_dtype}: no backend reads one; "
        f"K/V dtypes: torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, "
        f"torch.float8_e5m2, torch.int8")


@pytest.mark.skipif(not availability("cpu-varlen"), reason="cpu-varlen unavailable")
@pytest.mark.parametrize("options", [{}, {"work_units": 4, "split_min_keys": 1}], ids=["whole", "split"])
@pytest.mark.parametrize("scale, softcap, key_size", [(3e38, 30.0, 1.0), (4.0, None, 1e-30)],
                         ids=["huge-scale-capped", "huge-q-tiny-keys"])
def test_queries_that_overflow_once_scaled_are_not_nan_on_cpu_varlen(options, scale, softcap,
                                                                     key_size):
    # the kernel folds the scale into q: 3e38 x q was inf, inf . k NaN, every row NaN, where
    # softcap((q . k) x scale) is finite (reference, sdpa); so were q ~ 1e38 over tiny keys
    g = torch.Generator().manual_seed(32)
    kc = torch.randn(2, 8, 2, 16, generator=g) * key_size
    q = torch.randn(5, 4, 16, generator=g) * (1.0 if softcap else 1e38)
    view = VMemLayerView(kc, torch.randn(2, 8, 2, 16, generator=g), torch.tensor([1]),
                         torch.tensor([8]), torch.tensor([5]), softcap=softcap)
    want = get_backend("reference").forward(q, view, scale=scale)
    out = get_backend("cpu-varlen", **options).forward(q, view, scale=scale)
    assert want.isfinite().all()
    assert (out - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("extra", ["-w", "-Wno-unused-function"], ids=["w", "wno"])
def test_a_cc_with_arguments_builds_the_kernels(monkeypatch, tmp_path, extra):
    # CC="ccache gcc" / "gcc -m64" (as make takes it) was run as one file name: "[Errno 2] No
    # such file or directory: 'gcc -w'", cpu-varlen unavailable and the CPU default sdpa
    import shutil
    from vmemkv.runtime.attention import native
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("CC", f"{cc} {extra}")
    monkeypatch.setenv("VMEMKV_CACHE_DIR", str(tmp_path))
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    assert native.library(source).one() == 1


def test_a_cc_a_shell_cannot_split_makes_the_kernel_unavailable_naming_cc(monkeypatch, tmp_path):
    from vmemkv.runtime.attention import native
    monkeypatch.setenv("CC", 'gcc "-w')
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    with pytest.raises(native.KernelBuildError, match=r"""\$CC 'gcc "-w' is not a command line """
                                                      r"\(No closing quotation\)"):
        native.library(source)


@pytest.mark.parametrize("keyword, value", [("scale", True), ("scale", "0.5"), ("softcap", False),
                                            ("softcap", "30")],
                         ids=["scale-true", "scale-str", "softcap-false", "softcap-str"])
@pytest.mark.parametrize("name", ["reference", "sdpa", "cpu-varlen"])
def test_a_scale_or_softcap_that_is_no_number_is_refused_by_name(name, keyword, value):
    # scale=True ran as 1.0 and "0.5" as 0.5, silently (float() of each)
    q, view = _full_prefill_view(None)
    with pytest.raises(AttentionShapeError) as err:
        get_backend(name).forward(q, view, **{keyword: value})
    assert str(err.value) == f"{keyword} must be a number or None, got {value!r}"


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn, torch.int8],
                         ids=["fp16", "e4m3", "int8"])
@pytest.mark.parametrize("query_len", [1, 6], ids=["decode", "prefill"])
def test_sdpa_reads_kv_of_another_dtype_as_exactly_as_the_reference(kv_dtype, query_len):
    # sdpa cast K/V to q's dtype: fp16 K under bf16 q rounded to bf16, and at scores of ~900
    # the outputs moved by 0.125 (16 bf16 ulps at 1); the reference and cpu-varlen: 0
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 64, 1, 64, generator=g) * 30, torch.randn(1, 64, 1, 64, generator=g)
    scales = {}
    if kv_dtype != torch.float16:
        enc = kv_encoding(KV_NAMES[kv_dtype], torch.float32)
        ks, vs = first_write_scales(k[0], enc), first_write_scales(v[0], enc)
        k, v, scales = enc.quantize(k, ks), enc.quantize(v, vs), {"k_scale": ks, "v_scale": vs}
    q = (torch.randn(query_len, 1, 64, generator=g) * 30).bfloat16()
    view = VMemLayerView(k.to(kv_dtype), v.to(kv_dtype), torch.tensor([0]), torch.tensor([64]),
                         torch.tensor([query_len]), **scales)
    want = get_backend("reference").forward(q, view).float()
    assert (get_backend("sdpa").forward(q, view).float() - want).abs().max().item() <= 2**-8
