"""Attention behaviours pinned at their edges: the metadata refusals one past each limit (and
the limit itself accepted), and windows whose edge falls on the first key of a slice."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.attention import PagedLayerView, VMemLayerView, get_backend
from vmemkv.runtime.attention.errors import AttentionShapeError

from .test_attention_backends import make_case
from .test_window_attention import truth, windowed_vmem_view

CPU_BACKENDS = ["reference", "sdpa", "cpu-varlen"]


def _one(x: int) -> torch.Tensor:
    return torch.tensor([x])


def _vmem(max_batch: int = 2, max_ctx: int = 10, slot: int = 0, ctx: int = 3, qlen: int = 1):
    k, v = torch.randn(max_batch, max_ctx, 2, 16), torch.randn(max_batch, max_ctx, 2, 16)
    return VMemLayerView(k, v, _one(slot), _one(ctx), _one(qlen))


def _paged(num_blocks: int = 4, block_size: int = 4, table=(0, 1), ctx: int = 8, qlen: int = 1):
    k = torch.randn(num_blocks, block_size, 2, 16)
    v = torch.randn(num_blocks, block_size, 2, 16)
    tables = torch.tensor([list(table)], dtype=torch.int32)
    return PagedLayerView(k, v, tables, _one(ctx), _one(qlen))


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_request_with_no_query_tokens_is_refused_by_name(name):
    k, v = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    view = VMemLayerView(k, v, torch.tensor([0, 1]), torch.tensor([3, 4]), torch.tensor([0, 1]))
    with pytest.raises(AttentionShapeError, match="need 0 < query_len <= context_len"):
        get_backend(name).forward(torch.randn(1, 4, 16), view)


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("refused, read, message", [
    (dict(max_batch=2, slot=2), dict(max_batch=2, slot=1), r"distinct and in \[0, 2\)"),
    (dict(max_ctx=10, ctx=11), dict(max_ctx=10, ctx=10), "exceed max_context 10"),
], ids=["slot-past-max-batch", "context-past-max-context"])
def test_vmem_metadata_one_past_its_bound_is_refused_and_at_the_bound_is_read(name, refused,
                                                                              read, message):
    q = torch.randn(1, 4, 16)
    with pytest.raises(AttentionShapeError, match=message):
        get_backend(name).forward(q, _vmem(**refused))
    out = get_backend(name).forward(q, _vmem(**read))
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_block_table_one_entry_short_of_the_context_is_refused(name):
    q = torch.randn(1, 4, 16)
    with pytest.raises(AttentionShapeError, match="need 3 blocks of 4 tokens"):
        get_backend(name).forward(q, _paged(table=(0, 1), ctx=9))
    out = get_backend(name).forward(q, _paged(table=(0, 1), ctx=8))
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_block_id_equal_to_the_pool_size_is_refused(name):
    q = torch.randn(1, 4, 16)
    with pytest.raises(AttentionShapeError, match=r"block ids must be in \[0, 4\)"):
        get_backend(name).forward(q, _paged(num_blocks=4, table=(0, 4)))
    out = get_backend(name).forward(q, _paged(num_blocks=4, table=(0, 3)))
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_a_two_token_chunk_past_the_window_hides_the_slices_first_key_from_its_last_row():
    # window 4, context 10, 2 queries: the slice is keys 5..9 (window + 1 of them); the last
    # query (position 9) sees keys 6..9 only, the first (position 8) keys 5..8
    case = make_case([(10, 2), (30, 2)], seed=5)
    out = get_backend("sdpa").forward(case.q, windowed_vmem_view(case, 4))
    assert (out - truth(case, 4)).abs().max() < 1e-5


def test_cpu_varlen_takes_64_query_heads_per_kv_head_and_refuses_65():
    from vmemkv.runtime.attention.errors import UnsupportedError
    k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 6, 1, 16)
    view = VMemLayerView(k, v, _one(0), _one(6), _one(2))
    q = torch.randn(2, 64, 16)
    out = get_backend("cpu-varlen").forward(q, view)
    assert (out - get_backend("reference").forward(q, view)).abs().max() < 1e-5
    with pytest.raises(UnsupportedError, match="at most 64 query heads per KV head; got 65/1"):
        get_backend("cpu-varlen").forward(torch.randn(2, 65, 16), view)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_an_int8_cache_reads_k_and_v_each_with_its_own_scales(name):
    from vmemkv.runtime.attention.reference import dense_attention
    g = torch.Generator().manual_seed(3)
    k = torch.randint(-127, 128, (1, 6, 2, 16), generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, (1, 6, 2, 16), generator=g, dtype=torch.int8)
    k_scale, v_scale = torch.tensor([0.01, 0.02]), torch.tensor([0.05, 0.03])
    view = VMemLayerView(k, v, _one(0), _one(6), _one(2), k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(2, 4, 16, generator=g)
    want = dense_attention(q, k[0].float() * k_scale[:, None], v[0].float() * v_scale[:, None],
                           1 / 4)
    assert (get_backend(name).forward(q, view) - want).abs().max() < 1e-5


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_an_8bit_cache_scale_of_the_wrong_length_is_refused_by_name(name):
    k = torch.zeros(1, 6, 2, 16, dtype=torch.int8)
    one_scale, two = torch.tensor([0.5]), torch.tensor([0.5, 0.5])
    for k_scale, v_scale, bad in ((one_scale, two, "k_scale"), (two, one_scale, "v_scale")):
        view = VMemLayerView(k, k.clone(), _one(0), _one(6), _one(1), k_scale=k_scale,
                             v_scale=v_scale)
        with pytest.raises(AttentionShapeError, match=rf"needs {bad} fp32 \[2\]"):
            get_backend(name).forward(torch.randn(1, 4, 16), view)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_zero_attention_scale_is_refused(name):
    with pytest.raises(AttentionShapeError, match="scale must be finite and non-zero, got 0.0"):
        get_backend(name).forward(torch.randn(1, 4, 16), _vmem(), scale=0.0)


def test_the_cuda_causal_bias_path_still_applies_the_sliding_window():
    # attend_one's causal_lower_right bias (what sdpa uses on CUDA) has no window: a windowed
    # prefill chunk must take the bool mask instead
    from vmemkv.runtime.attention.kv import attend_one
    from vmemkv.runtime.attention.reference import dense_attention
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(3, 4, 16, generator=g), torch.randn(8, 2, 16, generator=g), \
        torch.randn(8, 2, 16, generator=g)
    out = attend_one(q, k, v, 0.25, causal_bias=True, window=4)
    assert (out - dense_attention(q, k, v, 0.25, window=4)).abs().max() < 1e-5


# ---- flash: how the kernel is asked for causal masks, windows and scales (no GPU needed) ----
def _recording_caps(params):
    from vmemkv.runtime.attention.flash import VarlenCaps
    seen = {}

    def kernel(q, *args, **kw):
        seen.update(kw, q=q)
    return VarlenCaps(kernel, frozenset(params)), seen


def test_call_varlen_asks_for_a_bottom_right_causal_mask_in_either_spelling():
    from vmemkv.runtime.attention.flash import call_varlen
    q = torch.zeros(2, 4, 16)
    caps, seen = _recording_caps({"scale", "window_size"})
    call_varlen(caps, q, q, q, None, None, 2, 2, 0.25, causal=True, gqa=False)
    assert seen["window_size"] == (-1, 0) and "is_causal" not in seen
    caps, seen = _recording_caps({"scale", "is_causal"})
    call_varlen(caps, q, q, q, None, None, 2, 2, 0.25, causal=True, gqa=False)
    assert seen["is_causal"] is True and "window_size" not in seen


def test_call_varlen_without_a_scale_argument_folds_the_scale_into_q():
    # the kernel then scales by 1/sqrt(head_dim) = 1/4: q must arrive as q * scale * 4
    from vmemkv.runtime.attention.flash import call_varlen
    q = torch.randn(2, 4, 16)
    caps, seen = _recording_caps({"is_causal"})
    call_varlen(caps, q, q, q, None, None, 2, 2, 0.5, causal=False, gqa=False)
    assert "scale" not in seen and torch.equal(seen["q"], q * 2.0)


def test_the_aten_flash_kernel_is_given_the_window_as_fa2_left_size(monkeypatch):
    from vmemkv.runtime.attention.flash import FlashBackend
    seen = {}

    def aten(*args, **kw):
        seen.update(kw, is_causal=args[8])
        return (args[0],)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", aten)
    q = torch.zeros(2, 4, 16)
    FlashBackend._aten_kernel(q, q, q, None, None, 1, 1, 0.25, None, causal=False, window=8)
    assert (seen["window_size_left"], seen["window_size_right"]) == (7, 0)
    assert seen["is_causal"] is True           # a window is causal, decode or not
