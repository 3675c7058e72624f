"""Every backend, on both layouts, returns what dense fp32 attention over the true K/V returns.

Caches are poisoned: every position a backend must not read (other slots, past context_len,
the tail of a request's last block, unused blocks, padding block-table entries) holds NaN, so
one stray read turns the result into NaN and the comparison fails.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vmemkv.runtime.attention import PagedLayerView, VMemLayerView, get_backend
from vmemkv.runtime.attention.reference import dense_attention

CPU_BACKENDS = ["reference", "sdpa", "cpu-varlen"]
CUDA_BACKENDS = ["reference", "sdpa", "flash", "flash-attn"]   # cpu-varlen: CPU only
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}
NAN_PADDING_BLOCK = 0   # block 0 is all NaN; padding table entries point at it


@dataclass
class Case:
    q: torch.Tensor                 # (tokens, H, D)
    keys: list[torch.Tensor]        # per request (ctx, Hkv, D): the truth
    values: list[torch.Tensor]
    context_lens: list[int]
    query_lens: list[int]


def make_case(spec, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", seed=0):
    """spec: [(context_len, query_len), ...]."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype, device=device)  # noqa: E731
    keys = [rnd(c, kv_heads, head_dim) for c, _ in spec]
    values = [rnd(c, kv_heads, head_dim) for c, _ in spec]
    q = rnd(sum(n for _, n in spec), heads, head_dim)
    return Case(q, keys, values, [c for c, _ in spec], [n for _, n in spec])


def _lens(case, device):
    return (torch.tensor(case.context_lens, device=device), torch.tensor(case.query_lens, device=device))


def vmem_view(case: Case, interleaved=False, spare_slots=2, spare_ctx=5, seed=1) -> VMemLayerView:
    """Slots assigned by a random permutation; everything not a live token is NaN."""
    n, (hkv, d) = len(case.keys), case.keys[0].shape[1:]
    max_batch, max_ctx = n + spare_slots, max(case.context_lens) + spare_ctx
    dev, dt = case.q.device, case.q.dtype
    if interleaved:   # [B, C, layers, Hkv, D]; layer 1's view is strided
        k_all = torch.full((max_batch, max_ctx, 3, hkv, d), math.nan, dtype=dt, device=dev)
        v_all = torch.full_like(k_all, math.nan)
        k, v = k_all[:, :, 1], v_all[:, :, 1]
    else:
        k = torch.full((max_batch, max_ctx, hkv, d), math.nan, dtype=dt, device=dev)
        v = torch.full_like(k, math.nan)
    slots = torch.randperm(max_batch, generator=torch.Generator().manual_seed(seed))[:n]
    for i, s in enumerate(slots.tolist()):
        c = case.context_lens[i]
        k[s, :c], v[s, :c] = case.keys[i], case.values[i]
    return VMemLayerView(k, v, slots.to(dev), *_lens(case, dev))


def paged_view(case: Case, block_size=4, spare_blocks=3, seed=1) -> PagedLayerView:
    """Blocks from a shuffled pool; block 0 and all tails are NaN; padding entries point at 0."""
    n, (hkv, d) = len(case.keys), case.keys[0].shape[1:]
    dev, dt = case.q.device, case.q.dtype
    need = [math.ceil(c / block_size) for c in case.context_lens]
    num_blocks = 1 + sum(need) + spare_blocks
    pool_k = torch.full((num_blocks, block_size, hkv, d), math.nan, dtype=dt, device=dev)
    pool_v = torch.full_like(pool_k, math.nan)
    ids = (1 + torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))).tolist()
    table = torch.full((n, max(need) + 2), NAN_PADDING_BLOCK, dtype=torch.int32)
    for i, nb in enumerate(need):
        mine, ids = ids[:nb], ids[nb:]
        table[i, :nb] = torch.tensor(mine, dtype=torch.int32)
        c = case.context_lens[i]
        flat_k = torch.full((nb * block_size, hkv, d), math.nan, dtype=dt, device=dev)
        flat_v = flat_k.clone()
        flat_k[:c], flat_v[:c] = case.keys[i], case.values[i]
        pool_k[mine] = flat_k.view(nb, block_size, hkv, d)
        pool_v[mine] = flat_v.view(nb, block_size, hkv, d)
    return PagedLayerView(pool_k, pool_v, table.to(dev), *_lens(case, dev))


def truth(case: Case) -> torch.Tensor:
    """Dense fp32 attention over the true per-request K/V (no cache involved)."""
    scale, outs, start = 1.0 / math.sqrt(case.q.shape[-1]), [], 0
    for k, v, n in zip(case.keys, case.values, case.query_lens):
        outs.append(dense_attention(case.q[start:start + n].float(), k.float(), v.float(), scale))
        start += n
    return torch.cat(outs)


def check(backend: str, case: Case, view, tol=None) -> None:
    out = get_backend(backend).forward(case.q, view)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not torch.isnan(out).any(), "a NaN leaked in: the backend read a position it must not"
    tol = tol or TOL[case.q.dtype]
    torch.testing.assert_close(out.float(), truth(case), atol=tol, rtol=tol)


def device_params(cpu_backends=CPU_BACKENDS, cuda_backends=CUDA_BACKENDS):
    gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    return ([pytest.param("cpu", b, id=f"cpu-{b}") for b in cpu_backends]
            + [pytest.param("cuda", b, id=f"cuda-{b}", marks=gpu) for b in cuda_backends])


def _dtype_for(device, backend):
    return torch.float16 if backend in ("flash", "flash-attn") else torch.float32


def _skip_unavailable(backend, layout=None, block_size=None):
    from vmemkv.runtime.attention import availability
    a = availability(backend)
    if not a:
        pytest.skip(a.reason)
    if backend == "flash-attn" and layout == "paged" and block_size % 256:
        pytest.skip("flash-attn paged needs block_size % 256 == 0")


SPECS = {
    "decode": [(9, 1), (17, 1), (1, 1), (33, 1)],
    "prefill_fresh": [(12, 12), (7, 7)],
    "prefill_after_prefix": [(20, 6), (13, 5)],
    "mixed": [(21, 1), (15, 15), (30, 7), (5, 1), (11, 3)],
}
LAYOUTS = ["vmem", "vmem-interleaved", "paged"]


def build_view(case, layout, block_size=4):
    if layout == "paged":
        return paged_view(case, block_size=block_size)
    return vmem_view(case, interleaved=layout == "vmem-interleaved")


@pytest.mark.parametrize("device,backend", device_params())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(SPECS))
def test_backend_matches_dense_reference_and_ignores_poisoned_memory(device, backend, layout, kind):
    block_size = 256 if backend == "flash-attn" else 4
    _skip_unavailable(backend, layout, block_size)
    case = make_case(SPECS[kind], dtype=_dtype_for(device, backend), device=device)
    check(backend, case, build_view(case, layout, block_size))


@pytest.mark.parametrize("device,backend", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_dtypes_match_reference(device, backend, dtype, layout):
    _skip_unavailable(backend)
    if backend in ("flash", "flash-attn") and dtype == torch.float32:
        pytest.skip("FlashAttention-2 has no fp32 kernel")
    if backend == "flash-attn" and layout == "paged":
        pytest.skip("covered with block_size 256 above")
    case = make_case(SPECS["mixed"], dtype=dtype, device=device, seed=3)
    check(backend, case, build_view(case, layout))


@pytest.mark.parametrize("device,backend", device_params())
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("layout", ["vmem", "paged"])
def test_grouped_query_attention(device, backend, heads, kv_heads, layout):
    _skip_unavailable(backend)
    if backend == "flash-attn" and layout == "paged":
        pytest.skip("covered with block_size 256 above")
    case = make_case(SPECS["mixed"], heads=heads, kv_heads=kv_heads,
                     dtype=_dtype_for(device, backend), device=device, seed=5)
    check(backend, case, build_view(case, layout))


@pytest.mark.parametrize("device,backend", device_params())
def test_realistic_head_dim_long_context(device, backend):
    """head_dim 128, ctx past the CPU kernel's KV split size, decode + prefill together."""
    _skip_unavailable(backend)
    case = make_case([(700, 1), (530, 64), (1025, 1)], heads=8, kv_heads=2, head_dim=128,
                     dtype=_dtype_for(device, backend), device=device, seed=7)
    check(backend, case, vmem_view(case))


@pytest.mark.parametrize("device,backend", device_params())
def test_explicit_scale_is_used(device, backend):
    _skip_unavailable(backend)
    case = make_case(SPECS["mixed"], dtype=_dtype_for(device, backend), device=device)
    view = vmem_view(case)
    a = get_backend(backend).forward(case.q, view, scale=0.5)
    b = get_backend("reference").forward(case.q, view, scale=0.5)
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[case.q.dtype], rtol=TOL[case.q.dtype])


def test_reference_agrees_with_truth_on_both_layouts():
    case = make_case(SPECS["mixed"])
    for view in (vmem_view(case), paged_view(case)):
        torch.testing.assert_close(get_backend("reference").forward(case.q, view), truth(case),
                                   atol=1e-6, rtol=1e-6)


def test_same_result_whatever_the_slot_assignment_and_block_order():
    case = make_case(SPECS["mixed"])
    sdpa = get_backend("sdpa")
    outs = [sdpa.forward(case.q, vmem_view(case, seed=s)) for s in range(3)]
    outs += [sdpa.forward(case.q, paged_view(case, seed=s)) for s in range(3)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)
