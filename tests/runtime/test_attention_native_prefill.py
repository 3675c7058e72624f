"""cpu-varlen runs every row in its native kernel: prefill chunks after any kv_start, sliding
windows, logit soft-caps, GQA, on vmem per-layer, vmem interleaved (strided rows) and paged,
unsplit and with key ranges split, against the dense fp32 reference (1e-5 in fp32); with the
cache stored in another ``kv_cache_dtype`` (16-bit under fp32 queries, 8-bit with per-head
scales) against the reference over the dequantized K/V, to the same 1e-5.

The truth for request i is dense attention of its queries over its keys ``kv_start_i .. ctx``
with the window and cap (``reference.dense_attention``); the cache holds NaN wherever the
backend must not read: other slots, past context_len, and every key before the view's
``kv_starts`` (the later of the explicit start and the window's start at the first query).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmemkv.runtime.attention import BatchLens, StepMeta, availability, get_backend
from vmemkv.runtime.attention.reference import dense_attention
from vmemkv.runtime.kv_dtype import KV_CACHE_DTYPES, first_write_scales, kv_encoding
from tests.runtime.test_attention_backends import make_case, paged_view, vmem_view

pytestmark = pytest.mark.skipif(not availability("cpu-varlen"),
                                reason=f"cpu-varlen unavailable: {availability('cpu-varlen').reason}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
LAYOUTS = ("vmem", "vmem-interleaved", "paged")
BLOCK = 4


def kernel(units=None):
    """cpu-varlen with every request in the kernel; ``units``: key ranges split to feed that many."""
    if units is None:
        return get_backend("cpu-varlen", sdpa_above_tokens=None)
    return get_backend("cpu-varlen", sdpa_above_tokens=None, work_units=units, split_min_keys=1)


def layer_view(case, layout: str, starts, window):
    """The layout's view with ``window``, explicit ``starts`` in its step metadata, and every key
    before the view's kv_starts poisoned (NaN)."""
    view = paged_view(case, block_size=BLOCK) if layout == "paged" else \
        vmem_view(case, interleaved=layout == "vmem-interleaved")
    lens = view.lens
    meta = StepMeta(BatchLens(lens.context_lens, lens.query_lens, lens.q_starts, tuple(starts)))
    view = dataclasses.replace(view, meta=meta, window=window)
    for i, first in enumerate(view.kv_starts):
        if view.kind == "vmem":
            slot = view.host_slots[i]
            view.k_cache[slot, :first] = math.nan
            view.v_cache[slot, :first] = math.nan
        for pos in range(first if view.kind == "paged" else 0):
            block = int(view.block_tables[i, pos // BLOCK])
            view.k_pool[block, pos % BLOCK] = math.nan
            view.v_pool[block, pos % BLOCK] = math.nan
    return view


def encoded(case, view, name):
    """(case, view) with the cache stored as ``kv_cache_dtype`` ``name`` (None / auto: as is):
    the view's tensors in the storage dtype, same strides (poison stays NaN but in int8), its
    scales (8-bit) per KV head from the live keys; the case's K/V the decoded values (the truth
    is the reference over those)."""
    enc = kv_encoding(name or "auto", case.q.dtype)
    if enc.storage == case.q.dtype:
        return case, view
    ks = first_write_scales(torch.cat(case.keys), enc) if enc.scaled else None
    vs = first_write_scales(torch.cat(case.values), enc) if enc.scaled else None
    code = lambda x, s: enc.dequantize(enc.quantize(x, s), s)   # noqa: E731
    case = dataclasses.replace(case, keys=[code(k, ks) for k in case.keys],
                               values=[code(v, vs) for v in case.values])

    def stored(t, s):
        out = torch.empty_strided(t.shape, t.stride(), dtype=enc.storage)
        out.copy_(enc.quantize(t, s))
        return out
    names = ("k_cache", "v_cache") if view.kind == "vmem" else ("k_pool", "v_pool")
    return case, dataclasses.replace(view, **{names[0]: stored(getattr(view, names[0]), ks),
                                              names[1]: stored(getattr(view, names[1]), vs)},
                                     k_scale=ks, v_scale=vs)


def truth(case, starts, window, softcap) -> torch.Tensor:
    scale, outs, row = 1.0 / math.sqrt(case.q.shape[-1]), [], 0
    for k, v, n, first in zip(case.keys, case.values, case.query_lens, starts):
        outs.append(dense_attention(case.q[row:row + n].float(), k[first:].float(),
                                    v[first:].float(), scale, window=window, softcap=softcap))
        row += n
    return torch.cat(outs)


def check(backend, case, view, starts, window, softcap) -> None:
    out = backend.forward(case.q, view, softcap=softcap)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not torch.isnan(out).any(), "a NaN leaked in: the kernel read a key it must not"
    tol = TOL[case.q.dtype]
    torch.testing.assert_close(out.float(), truth(case, starts, window, softcap), atol=tol, rtol=tol)


@st.composite
def chunks(draw):
    """(spec [(ctx, qlen)], explicit kv_starts, heads, kv_heads, head_dim, window, softcap)."""
    spec = []
    for _ in range(draw(st.integers(1, 4))):
        ctx = draw(st.integers(1, 140))
        qlen = draw(st.sampled_from([1, ctx, None])) or draw(st.integers(1, min(ctx, 70)))
        spec.append((ctx, qlen))
    starts = [draw(st.integers(0, c - q)) if draw(st.booleans()) else 0 for c, q in spec]
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 3, 4, 8]))
    window = draw(st.sampled_from([None, 1, 5, 33, 64]))
    softcap = draw(st.sampled_from([None, 2.0, 30.0]))
    return spec, starts, heads, kv_heads, draw(st.sampled_from([16, 20, 32, 64, 80])), window, softcap


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks(), st.sampled_from(LAYOUTS), st.sampled_from([None, 7]), st.integers(0, 2**16),
       st.sampled_from(KV_CACHE_DTYPES))
def test_prefill_chunks_windows_and_softcaps_match_the_fp32_reference(chunk, layout, units, seed,
                                                                      kv):
    spec, starts, heads, kv_heads, head_dim, window, softcap = chunk
    case = make_case(spec, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=seed)
    case.q.mul_(3)                                   # scores large enough for a cap to bite
    case, view = encoded(case, layer_view(case, layout, starts, window), kv)
    check(kernel(units), case, view, starts, window, softcap)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, kv", [(torch.float32, None), (torch.bfloat16, None),
                                       (torch.float32, "fp8_e4m3"), (torch.float32, "fp8_e5m2"),
                                       (torch.float32, "int8"), (torch.float32, "bf16")],
                         ids=["fp32", "bf16", "fp32-e4m3", "fp32-e5m2", "fp32-int8", "fp32-kv-bf16"])
def test_a_long_prefill_chunk_after_a_window_start_with_head_dim_128(layout, dtype, kv):
    """Chunks of 64-200 tokens (several items of 64 / G positions each), a 96-token window
    (later items start their keys after earlier ones), a cap, Llama-3-8B's 4 query heads per
    KV head at head_dim 128 (the compiled size), a decode beside them; K/V as stored in each
    kv_cache_dtype (the reference over the decoded values)."""
    spec, starts, window, softcap = [(600, 200), (300, 64), (257, 1)], [40, 0, 250], 96, 20.0
    case = make_case(spec, heads=16, kv_heads=4, head_dim=128, dtype=dtype, seed=5)
    case.q.mul_(3)
    case, view = encoded(case, layer_view(case, layout, starts, window), kv)
    for backend in (kernel(), kernel(units=5)):
        check(backend, case, view, starts, window, softcap)


@pytest.mark.parametrize("layout", ["vmem", "paged"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 200, 256])
def test_fp8_head_sizes_with_whole_and_partial_blocks_of_64_match_the_reference(head_dim, kv,
                                                                                 layout):
    """With AVX-512 VBMI the kernel reads fp8 64 elements at a time in a transposed order and
    puts its queries and accumulators in that order around the walk: head sizes of one block
    (64), a block and a vector (80), a block and two vectors (96), three blocks and a scalar
    tail (200) and four blocks (256); a decode (two KV heads an item), a 2-token chunk (K in
    blocks, V widened to fp32) and a 40-token chunk (one KV head: K and V widened), unsplit and
    split. Every CPU runs the same checks on the path it has."""
    spec, starts = [(150, 1), (97, 2), (70, 1), (120, 40)], [0, 3, 60, 11]
    case = make_case(spec, heads=8, kv_heads=2, head_dim=head_dim, seed=head_dim)
    case, view = encoded(case, layer_view(case, layout, starts, None), kv)
    for backend in (kernel(), kernel(units=5)):
        check(backend, case, view, starts, None, None)


def test_the_cap_changes_the_result_and_a_wide_window_is_full_attention():
    """Guards on the tests above: the cap bites at these scores; a window past every key
    equals no window."""
    spec, starts = [(50, 20), (33, 1)], [0, 0]
    case = make_case(spec, heads=8, kv_heads=2, seed=2)
    case.q.mul_(3)
    capped = kernel().forward(case.q, layer_view(case, "vmem", starts, None), softcap=2.0)
    plain = kernel().forward(case.q, layer_view(case, "vmem", starts, None))
    assert not torch.allclose(capped, plain, atol=1e-3)
    wide = kernel().forward(case.q, layer_view(case, "paged", starts, 64))
    torch.testing.assert_close(wide, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_and_sdpa_above_tokens_agree_on_windowed_capped_mixed_steps(layout):
    """The per-request SDPA option (``sdpa_above_tokens=2``) and the all-kernel default give the
    same answer on a windowed, soft-capped mixed step."""
    spec, starts, window = [(90, 30), (40, 1), (70, 3)], [0, 10, 5], 24
    case = make_case(spec, heads=8, kv_heads=2, head_dim=32, seed=8)
    view = layer_view(case, layout, starts, window)
    for backend in (get_backend("cpu-varlen"), get_backend("cpu-varlen", sdpa_above_tokens=2)):
        check(backend, case, view, starts, window, 5.0)


def build_with(monkeypatch, vector_lanes: int, vbmi: bool = True) -> None:
    """Every kernel the backend loads from here on built ``vector_lanes`` wide (and with
    ``vbmi=False`` as for an AVX-512 CPU without VBMI, even where this CPU has it)."""
    from vmemkv.runtime.attention import native
    build = native.kernel
    monkeypatch.setattr(native, "kernel", lambda head_dim, dtype_code:
                        build(head_dim, dtype_code, vector_lanes, vbmi))


@pytest.mark.parametrize("vector_lanes", [8, 16])
def test_both_vector_widths_match_the_reference_with_every_row_of_an_item(vector_lanes,
                                                                          monkeypatch):
    """The kernel built with 8 fp32 lanes (AVX2) and with 16 (AVX-512), whichever this CPU has:
    one KV head with 8 query heads and a 40-token chunk fills items of 64 rows, 8 row vectors
    of 8 lanes, so the GEMM path must walk all of them (it once stopped at the fourth)."""
    build_with(monkeypatch, vector_lanes)
    spec = [(48, 40), (40, 40)]
    case = make_case(spec, heads=8, kv_heads=1, head_dim=32, seed=vector_lanes)
    starts = [0, 0]
    check(kernel(), case, layer_view(case, "vmem", starts, None), starts, None, None)


@pytest.mark.parametrize("kv", ["bf16", "fp16", "int8"])
def test_the_8_lane_build_reads_16_bit_and_int8_caches_as_the_reference(kv, monkeypatch):
    """The 8-lane build (AVX2), which this CPU does not run by default, on the K/V reads it does
    differently (bf16, fp16, int8); decodes and a prefill chunk beside them, key ranges split
    too."""
    build_with(monkeypatch, 8)
    spec, starts = [(90, 1), (45, 1), (120, 40)], [0, 3, 0]
    case = make_case(spec, heads=8, kv_heads=2, head_dim=128, seed=11)
    case, view = encoded(case, layer_view(case, "paged", starts, None), kv)
    for backend in (kernel(), kernel(units=5)):
        check(backend, case, view, starts, None, None)


def poke(view, which: str, request: int, pos: int, head: int, dim: int, byte: int) -> None:
    """Store ``byte`` as the raw 8-bit element of ``which`` ("k" / "v") at that place."""
    if view.kind == "vmem":
        cache = view.k_cache if which == "k" else view.v_cache
        row = cache[int(view.host_slots[request]), pos]
    else:
        pool = view.k_pool if which == "k" else view.v_pool
        row = pool[int(view.block_tables[request, pos // BLOCK]), pos % BLOCK]
    row[head, dim:dim + 1].view(torch.uint8).fill_(byte)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim, vector_lanes, vbmi",
                         [(32, 16, True), (128, 16, True), (128, 16, False), (128, 8, True),
                          (256, 8, True), (272, 16, True), (272, 16, False)])
def test_e4m3_nan_bytes_a_decode_reads_give_nan_exactly_where_the_reference_does(
        layout, head_dim, vector_lanes, vbmi, monkeypatch):
    """A NaN byte in a K row makes every row of that head NaN, one in a V row that element of
    its rows' outputs, as in the reference over the decoded values; other requests and heads
    are untouched, with key ranges split too. The 16-lane build reads e4m3 by table where the
    CPU has AVX-512 VBMI (NaN bytes NaN as read); the 8-lane one, and the 16-lane one without
    the table (an AVX-512 CPU without VBMI), read their rows without turning 0x7F / 0xFF into
    NaN and watch the bytes they read for them instead, walking a unit again with the NaN step
    when they meet one (a walk that kept the finite reading fails here); 256 at 8 lanes and
    272 (the any-size build) at 16 are over KR_VECS vectors, so each K row is scored in two
    pieces."""
    build_with(monkeypatch, vector_lanes, vbmi)
    spec, starts = [(70, 1), (45, 1), (90, 1)], [0, 0, 0]
    case = make_case(spec, heads=8, kv_heads=2, head_dim=head_dim, seed=9)
    case, view = encoded(case, layer_view(case, layout, starts, None), "fp8_e4m3")
    poke(view, "k", request=0, pos=33, head=1, dim=5, byte=0x7F)
    poke(view, "v", request=1, pos=44, head=0, dim=head_dim - 1, byte=0xFF)
    case.keys[0][33, 1, 5] = math.nan
    case.values[1][44, 0, head_dim - 1] = math.nan
    want = truth(case, starts, None, None)
    assert want[0, 4:].isnan().all() and not want[0, :4].isnan().any()
    assert want[1, :4, -1].isnan().all() and not want[1, :4, :-1].isnan().any()
    assert not want[1, 4:].isnan().any() and not want[2].isnan().any()
    for backend in (kernel(), kernel(units=5)):
        out = backend.forward(case.q, view)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, equal_nan=True)


def fill_row(view, which: str, request: int, pos: int, codes: torch.Tensor) -> None:
    """Store ``codes`` (uint8 [Hkv, D]) as the raw 8-bit K or V row of that token."""
    for head in range(codes.shape[0]):
        for dim in range(codes.shape[1]):
            poke(view, which, request, pos, head, dim, int(codes[head, dim]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("vector_lanes, vbmi", [(8, True), (16, True), (16, False)])
@pytest.mark.parametrize("name, dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8_e5m2", torch.float8_e5m2)])
def test_every_fp8_byte_is_read_as_its_value(name, dtype, layout, vector_lanes, vbmi,
                                             monkeypatch):
    """All 256 bytes, subnormals, NaNs and e5m2's infinities among them, in one token's V row
    (two KV heads x 128): a one-key decode gives exactly that row's values times the V scale
    (p is 1, so nothing but the reading can differ), NaN and inf where they are. The finite
    bytes in a K row, before a second key, score as the reference over the decoded values
    (1e-5). In the 16-lane build (by table where the CPU has AVX-512 VBMI), the 16-lane one
    without the table and the 8-lane one (both F16C)."""
    build_with(monkeypatch, vector_lanes, vbmi)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128)
    finite = every.clone()
    finite[~every.view(dtype).float().isfinite()] = 0
    decode = lambda codes, scale: codes.view(dtype).float() * scale.view(-1, 1)   # noqa: E731
    case = make_case([(1, 1), (2, 1)], heads=8, kv_heads=2, head_dim=128, seed=3)
    starts = [0, 0]
    case, view = encoded(case, layer_view(case, layout, starts, None), name)
    fill_row(view, "v", request=0, pos=0, codes=every)
    fill_row(view, "k", request=1, pos=0, codes=finite)
    case.values[0][0] = decode(every, view.v_scale)
    case.keys[1][0] = decode(finite, view.k_scale)
    out = kernel().forward(case.q, view)
    want = case.values[0][0].unsqueeze(1).expand(2, 4, 128)
    assert want.isnan().any() and not out[1].isnan().any()
    torch.testing.assert_close(out[0].view(2, 4, 128), want, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(out[1], truth(case, starts, None, None)[1], atol=1e-5, rtol=1e-5)
