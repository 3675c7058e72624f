"""cpu-varlen's split key ranges (flash-decoding): partial softmaxes over contiguous key ranges,
merged exactly, give the dense fp32 result.

Every split here is forced with ``work_units`` (the thread count is not needed): 1,000 keys from
kv_start 37 in 8 splits of 120-121 keys (neither a multiple of the 64-key tile nor of the split),
and a mixed batch whose splits include single keys and keys that one of a request's query rows
does not see (an empty partial for that row).
"""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.attention import BatchLens, availability, get_backend
from vmemkv.runtime.attention.cpu_varlen import _Split, _splits_wanted, _with_splits
from tests.runtime.test_attention_backends import make_case, paged_view, vmem_view
from tests.runtime.test_attention_batched import TOL, check, with_kv_starts

pytestmark = pytest.mark.skipif(not availability("cpu-varlen"),
                                reason=f"cpu-varlen unavailable: {availability('cpu-varlen').reason}")
HEADS = {"wide rows (32/8 x 128)": (32, 8, 128), "small heads (8/2 x 32)": (8, 2, 32)}


def split_backend(units: int):
    return get_backend("cpu-varlen", sdpa_above_tokens=None, work_units=units, split_min_keys=1)


def view_of(case, layout, starts):
    view = paged_view(case, block_size=16) if layout == "paged" else vmem_view(case)
    return with_kv_starts(view, starts, block_size=16) if any(starts) else view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["vmem", "paged"])
@pytest.mark.parametrize("heads", HEADS, ids=list(HEADS))
def test_a_decode_split_eight_ways_matches_dense_truth(heads, layout, dtype):
    spec, starts = [(1000, 1)], [37]
    h, hkv, d = HEADS[heads]
    case = make_case(spec, heads=h, kv_heads=hkv, head_dim=d, dtype=dtype, seed=21)
    check(split_backend(8), case, view_of(case, layout, starts), starts)


@pytest.mark.parametrize("layout", ["vmem", "paged"])
def test_a_split_mixed_batch_with_windows_matches_dense_truth(layout):
    spec, starts = [(300, 2), (130, 1), (77, 1)], [5, 0, 70]   # request 2: 7 keys in 6 splits
    case = make_case(spec, heads=8, kv_heads=2, head_dim=32, seed=4)
    check(split_backend(16), case, view_of(case, layout, starts), starts)


def test_items_split_below_the_work_units_or_when_they_do_not_share_out_and_never_under_min_keys():
    lens = BatchLens((2048, 300, 2048), (1, 1, 2), (0, 1, 2), (0, 0, 1000))
    items = [(0, 0, 1, 0, 8), (1, 0, 1, 0, 8), (2, 0, 2, 0, 8)]
    splits = lambda units, min_keys: [it[5] for it in _with_splits(  # noqa: E731
        items, lens, lens.kv_starts, _Split(units, min_keys))]
    assert splits(3, 256) == [1, 1, 1]          # as many items as units: nothing split
    assert splits(8, 256) == [3, 1, 3]          # ceil(8 / 3); 300 keys make one split of >= 256
    assert splits(8, 400) == [3, 1, 2]          # request 2 sees 2048 - 1000 = 1,048 keys
    assert splits(2, 256) == [2, 1, 2]          # 3 items on 2 units: 6 units, 3 a thread
    assert splits(1, 256) == [1, 1, 1]          # one unit: every count shares out
    assert [_splits_wanted(n, 2) for n in (1, 2, 3, 4, 5, 7, 8, 9)] == [2, 1, 2, 1, 2, 2, 1, 1]
    assert _splits_wanted(17, 16) == 6          # 102 units in 7 rounds of 16: 9% idle
    one = [items[0]]
    assert [it[5] for it in _with_splits(one, lens, lens.kv_starts, _Split(2, 256))] == [2]


def test_bad_split_options_are_a_typed_error():
    from vmemkv.runtime.attention import UnsupportedError
    with pytest.raises(UnsupportedError, match="work_units must be >= 1 or None; got 0"):
        get_backend("cpu-varlen", work_units=0)
    with pytest.raises(UnsupportedError, match="split_min_keys must be >= 1; got 0"):
        get_backend("cpu-varlen", split_min_keys=0)


@pytest.mark.parametrize("splits", [1, 2])
def test_scratch_that_cannot_be_allocated_is_minus_one_then_a_memory_error(splits, monkeypatch):
    """A head size of 2**52 asks for 2**55 bytes or more of scratch (per thread unsplit, for the
    partials split): malloc refuses, nothing is touched, the kernel answers -1."""
    from vmemkv.runtime.attention import native
    from vmemkv.runtime.attention.cpu_varlen import _ptr
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    keep = [i64(1, 1, 1), i64(0), i64(10), i64(1), i64(0), i64(0), i64(0, 0, 1, 0, 1, splits)]
    strides, slots, ctx, qlen, qstart, kvstart, items = map(_ptr, keep)
    rc = native.kernel(2**52, 0)(None, None, None, None, 0, None, None, strides, strides, slots, None,
                         0, 0, ctx, qlen, qstart, kvstart, items, 1, 1, 1, 2**52, 1.0, 0, 0.0, 1)
    assert rc == -1
    case = make_case([(10, 1)])
    monkeypatch.setattr(native, "kernel", lambda head_dim, dtype_code: lambda *args: -1)
    with pytest.raises(MemoryError, match="could not allocate its scratch memory"):
        get_backend("cpu-varlen").forward(case.q, vmem_view(case))
