"""Registry and typed errors: names resolve lazily, failures say what is wrong."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.attention import (AttentionError, AttentionShapeError, BackendUnavailableError,
                               UnknownBackendError, UnsupportedError, VMemLayerView, availability,
                               backend_names, describe_backends, fastest_backend, get_backend)
from tests.runtime.test_attention_backends import SPECS, make_case, paged_view, vmem_view


def test_unknown_backend_lists_known_names():
    with pytest.raises(UnknownBackendError) as e:
        get_backend("flashy")
    for name in ("reference", "sdpa", "flash", "flash-attn"):
        assert name in str(e.value)
    assert isinstance(e.value, AttentionError)


def test_every_backend_declares_devices_layouts_and_availability():
    rows = {r["name"]: r for r in describe_backends()}
    assert set(rows) == set(backend_names())
    for r in rows.values():
        assert set(r["devices"]) <= {"cpu", "cuda"} and set(r["kinds"]) <= {"vmem", "paged"}
        assert r["available"] or r["reason"], "an unavailable backend must say why"
    assert rows["sdpa"]["available"] and rows["reference"]["available"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_backends_unavailable_on_cpu_say_why():
    for name in ("flash", "flash-attn"):
        with pytest.raises(BackendUnavailableError) as e:
            get_backend(name)
        assert name in str(e.value) and len(e.value.reason) > 10


def test_fastest_backend_is_available_and_supports_the_layout():
    for layout in ("vmem", "paged"):
        name = fastest_backend(layout, "cpu")
        assert name == ("cpu-varlen" if availability("cpu-varlen") else "sdpa")
        assert get_backend(name).supports(layout, "cpu")
    with pytest.raises(UnsupportedError):
        fastest_backend("ring", "cpu")


def test_wrong_device_for_backend_is_a_typed_error():
    from vmemkv.runtime.attention.flash import FlashBackend
    case = make_case(SPECS["decode"], dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="cuda"):
        FlashBackend().forward(case.q, vmem_view(case))


def test_shape_mismatches_name_the_shapes():
    from vmemkv.runtime.attention.flash import FlashBackend
    sdpa = get_backend("sdpa")
    case = make_case(SPECS["mixed"])
    view = vmem_view(case)
    with pytest.raises(AttentionShapeError, match=r"\(18, 4, 16\)"):
        sdpa.forward(case.q[:18], view)                          # query_lens don't sum to 18
    with pytest.raises(AttentionShapeError, match="multiple of kv_heads"):
        sdpa.forward(case.q[:, :3], view)                        # 3 heads over 2 KV heads
    with pytest.raises(AttentionShapeError, match="head_dim"):
        sdpa.forward(case.q[..., :8], view)
    out = sdpa.forward(case.q.half(), view)        # K/V of another dtype: cast to q's
    torch.testing.assert_close(out.float(), sdpa.forward(case.q.half().float(), view),
                               atol=2e-2, rtol=2e-2)
    with pytest.raises(UnsupportedError, match="kv_cache_dtype"):   # flash reads only q's dtype
        FlashBackend().check_runs("vmem", "cuda", torch.float16, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(UnsupportedError, match="dtypes"):
        sdpa.forward(case.q.double(), view)


def test_bad_metadata_is_rejected_before_any_read():
    sdpa = get_backend("sdpa")
    case = make_case(SPECS["decode"])
    v = vmem_view(case)
    too_long = VMemLayerView(v.k_cache, v.v_cache, v.slots, v.context_lens + 100, v.query_lens)
    with pytest.raises(AttentionShapeError, match="max_context"):
        sdpa.forward(case.q, too_long)
    dup = VMemLayerView(v.k_cache, v.v_cache, torch.zeros_like(v.slots), v.context_lens, v.query_lens)
    with pytest.raises(AttentionShapeError, match="distinct"):
        sdpa.forward(case.q, dup)
    p = paged_view(case)
    p.block_tables[0, 0] = 10_000
    with pytest.raises(AttentionShapeError, match="block ids"):
        sdpa.forward(case.q, p)


def test_fastest_backend_skips_backends_without_the_dtype(monkeypatch):
    """As on a CUDA machine with both flash backends: fp32 has no FA2 kernel, so sdpa."""
    from vmemkv.runtime.attention import registry
    from vmemkv.runtime.attention.base import Availability
    monkeypatch.setattr(registry, "availability", lambda name: Availability(True))
    assert fastest_backend("vmem", "cuda", dtype=torch.float32) == "sdpa"
    assert fastest_backend("vmem", "cuda", dtype=torch.float16) == "flash-attn"
    assert fastest_backend("paged", "cuda", block_size=16, dtype=torch.bfloat16) == "flash"
    assert fastest_backend("paged", "cuda", block_size=256) == "flash-attn"


@pytest.mark.parametrize("name", ["reference", "sdpa", "cpu-varlen"])
def test_inputs_a_kernel_would_misread_are_refused_by_name(name):
    # cpu-varlen read V with K's element type (fp32 K, bf16 V: NaN, or past V's end: SIGSEGV);
    # zero heads were a ZeroDivisionError; float lens and slots were truncated (slot 1.9 read
    # as slot 1); an infinite soft-cap or a NaN scale made every output NaN
    backend = get_backend(name)
    k, v = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    one, q = (lambda x: torch.tensor([x])), torch.randn(1, 4, 16)
    cases = [
        (q, VMemLayerView(k, v.bfloat16(), one(0), one(3), one(1)), {}, "must share a dtype"),
        (torch.randn(1, 4, 0), VMemLayerView(k[..., :0], v[..., :0], one(0), one(3), one(1)), {},
         "head_dim >= 1"),
        (torch.randn(1, 0, 16), VMemLayerView(k[:, :, :0], v[:, :, :0], one(0), one(3), one(1)),
         {}, "kv_heads and head_dim >= 1"),
        (q, VMemLayerView(k, v, one(0), one(3.7), one(1)), {}, "context_lens must be an integer"),
        (q, VMemLayerView(k, v, one(0), one(3), one(1.0)), {}, "query_lens must be an integer"),
        (q, VMemLayerView(k, v, one(1.9), one(3), one(1)), {}, "slots must be an integer"),
        (q, VMemLayerView(k, v, one(0), one(3), one(1)), dict(softcap=float("inf")),
         "softcap must be finite"),
        (q, VMemLayerView(k, v, one(0), one(3), one(1)), dict(scale=float("nan")),
         "scale must be finite"),
    ]
    for query, view, kwargs, words in cases:
        with pytest.raises(AttentionShapeError, match=words):
            backend.forward(query, view, **kwargs)
    case = make_case(SPECS["decode"])
    p = paged_view(case)
    floats = type(p)(p.k_pool, p.v_pool, p.block_tables.float() + 0.5, p.context_lens,
                     p.query_lens)
    with pytest.raises(AttentionShapeError, match="block_tables must be an integer"):
        backend.forward(case.q, floats)


def test_an_empty_attention_name_is_unknown_not_the_default():
    from vmemkv.runtime.engine import Engine
    from vmemkv.runtime.models import build_model
    with pytest.raises(UnknownBackendError, match="unknown attention backend ''"):
        Engine(build_model("tiny-llama"), attention="")
