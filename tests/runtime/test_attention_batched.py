"""The batched CPU path (``cpu-varlen``) and per-sequence key starts, against dense fp32 truth.

Random mixes (hypothesis): batch sizes, context and query lengths (decode, prefill, mixed), GQA
ratios, fp32 / bf16, key starts, vmem (per-layer and interleaved) and paged; the kernel unsplit
and with its key ranges split (up to 12 ways, single keys allowed). Every position a
backend must not read is NaN: other slots, past context_len, the tail of a last block, padding
table entries, and the keys before each request's kv_start.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmemkv.runtime.attention import (AttentionShapeError, BatchLens, PagedLayerView, StepMeta,
                                      UnsupportedError, VMemLayerView, availability, get_backend)
from vmemkv.runtime.attention.reference import dense_attention
from vmemkv.runtime.attention.sdpa import SdpaBackend
from tests.runtime.test_attention_backends import Case, make_case, paged_view, vmem_view

pytestmark = pytest.mark.skipif(not availability("cpu-varlen"),
                                reason=f"cpu-varlen unavailable: {availability('cpu-varlen').reason}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
LAYOUTS = ("vmem", "vmem-interleaved", "paged")


def with_kv_starts(view, kv_starts, block_size: int = 4):
    """The same view with ``kv_starts`` in its step metadata, keys before them poisoned (NaN)."""
    lens = view.lens
    meta = StepMeta(BatchLens(lens.context_lens, lens.query_lens, lens.q_starts, tuple(kv_starts)))
    for i, start in enumerate(kv_starts):
        if view.kind == "vmem":
            slot = int(view.slots[i])
            view.k_cache[slot, :start] = math.nan
            view.v_cache[slot, :start] = math.nan
        else:
            for pos in range(start):
                block = int(view.block_tables[i, pos // block_size])
                view.k_pool[block, pos % block_size] = math.nan
                view.v_pool[block, pos % block_size] = math.nan
    return dataclasses.replace(view, meta=meta)


def truth(case: Case, kv_starts) -> torch.Tensor:
    """Dense fp32 attention of each request over its true keys kv_start .. ctx - 1."""
    scale, outs, start = 1.0 / math.sqrt(case.q.shape[-1]), [], 0
    for k, v, n, first in zip(case.keys, case.values, case.query_lens, kv_starts):
        outs.append(dense_attention(case.q[start:start + n].float(), k[first:].float(),
                                    v[first:].float(), scale))
        start += n
    return torch.cat(outs)


def build(case: Case, layout: str, kv_starts):
    view = (paged_view(case, block_size=4) if layout == "paged"
            else vmem_view(case, interleaved=layout == "vmem-interleaved"))
    return with_kv_starts(view, kv_starts) if any(kv_starts) else view


def check(backend, case: Case, view, kv_starts) -> None:
    out = backend.forward(case.q, view)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not torch.isnan(out).any(), "a NaN leaked in: the backend read a position it must not"
    tol = TOL[case.q.dtype]
    torch.testing.assert_close(out.float(), truth(case, kv_starts), atol=tol, rtol=tol)


@st.composite
def mixes(draw):
    """(spec [(ctx, qlen)], kv_starts, heads, kv_heads, dtype, layout)."""
    n = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    spec = []
    for _ in range(n):
        ctx = draw(st.integers(1, 150))
        qlen = {"decode": 1, "prefill": ctx}.get(kind) or draw(st.integers(1, min(ctx, 40)))
        spec.append((ctx, qlen))
    starts = [draw(st.integers(0, c - q)) if draw(st.booleans()) else 0 for c, q in spec]
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4, 8]))
    return (spec, starts, heads, kv_heads, draw(st.sampled_from([torch.float32, torch.bfloat16])),
            draw(st.sampled_from(LAYOUTS)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixes(), st.integers(0, 2**16))
def test_batched_path_matches_dense_truth_on_random_mixes(mix, seed):
    spec, starts, heads, kv_heads, dtype, layout = mix
    case = make_case(spec, heads=heads, kv_heads=kv_heads, head_dim=16, dtype=dtype, seed=seed)
    view = build(case, layout, starts)
    split = get_backend("cpu-varlen", sdpa_above_tokens=None, work_units=12, split_min_keys=1)
    for backend in (get_backend("cpu-varlen"), get_backend("cpu-varlen", sdpa_above_tokens=2),
                    split, get_backend("sdpa"), get_backend("reference")):
        check(backend, case, view, starts)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threshold", [None, 2])
def test_keys_before_kv_start_are_never_read_for_their_contents(layout, threshold):
    """Keys before kv_start are NaN; decode, a prefill chunk and a fresh prefill see none."""
    spec, starts = [(40, 1), (30, 6), (25, 25), (70, 1)], [9, 24, 0, 69]
    case = make_case(spec, heads=8, kv_heads=2, head_dim=32, seed=11)
    check(get_backend("cpu-varlen", sdpa_above_tokens=threshold), case, build(case, layout, starts),
          starts)


def test_long_contexts_and_head_dim_128_cross_many_key_tiles():
    spec = [(700, 1), (530, 2), (1025, 1), (300, 80)]
    case = make_case(spec, heads=32, kv_heads=8, head_dim=128, seed=7)
    for threshold in (None, 2):
        check(get_backend("cpu-varlen", sdpa_above_tokens=threshold), case, vmem_view(case),
              [0] * 4)


@pytest.mark.parametrize("kv_heads", [2, 8])
@pytest.mark.parametrize("head_dim", [8, 20, 32, 64, 128, 256])  # compiled sizes, and others
def test_every_head_size_matches_dense_truth_in_decode_and_prefill_items(head_dim, kv_heads):
    """Head sizes the kernel compiles (32-256), one below a vector (8) and one with a scalar
    tail (20); decodes (every KV head in one item), a 2-token chunk and a 40-token chunk
    (items of 16 positions of one KV head)."""
    spec, starts = [(150, 1), (97, 2), (70, 1), (120, 40)], [0, 3, 60, 11]
    case = make_case(spec, heads=4 * kv_heads, kv_heads=kv_heads, head_dim=head_dim, seed=9)
    check(get_backend("cpu-varlen", sdpa_above_tokens=None), case, build(case, "paged", starts),
          starts)


def test_kv_starts_out_of_range_are_a_typed_error_naming_the_value():
    case = make_case([(10, 3), (8, 1)])
    view = vmem_view(case)
    for bad in ([8, 0], [-1, 0], [0, 8]):       # 10 - 3 = 7 is the largest start for request 0
        lens = BatchLens(view.lens.context_lens, view.lens.query_lens, view.lens.q_starts, tuple(bad))
        bad_view = VMemLayerView(view.k_cache, view.v_cache, view.slots, view.context_lens,
                                 view.query_lens, meta=StepMeta(lens))
        with pytest.raises(AttentionShapeError, match="kv_starts"):
            get_backend("cpu-varlen").forward(case.q, bad_view)


def test_a_backend_without_kv_starts_refuses_them():
    class NoStarts(SdpaBackend):
        supports_kv_starts = False
    case = make_case([(10, 1), (8, 1)])
    view = with_kv_starts(vmem_view(case), [2, 0])
    with pytest.raises(UnsupportedError, match="kv_starts"):
        NoStarts().forward(case.q, view)
    plain = vmem_view(case)                     # all starts 0: nothing to refuse
    NoStarts().forward(case.q, plain)


def test_same_result_whatever_the_thread_count():
    case = make_case([(90, 1), (33, 1), (64, 1), (7, 1), (120, 1)], heads=8, kv_heads=2, seed=3)
    view, threads = vmem_view(case), torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(get_backend("cpu-varlen").forward(case.q, vmem_view(case, seed=5)))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
    check(get_backend("cpu-varlen"), case, view, [0] * 5)


def test_bad_options_are_a_typed_error():
    with pytest.raises(UnsupportedError, match="sdpa_above_tokens"):
        get_backend("cpu-varlen", sdpa_above_tokens=0)
    case = make_case([(5, 1)], heads=130, kv_heads=2)    # 65 query heads per KV head
    with pytest.raises(UnsupportedError, match="at most 64"):
        get_backend("cpu-varlen").forward(case.q, vmem_view(case))


def test_forward_time_is_counted():
    case = make_case([(20, 1), (9, 3)])
    backend = get_backend("cpu-varlen")
    assert backend.forward_s == 0.0
    backend.forward(case.q, paged_view(case))
    assert backend.forward_s > 0.0
