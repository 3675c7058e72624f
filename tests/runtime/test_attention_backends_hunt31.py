"""Hunt 31 (attention backends): each CPU backend against an fp64 reference on the configurations
that once went wrong, and the backend choice's errors."""
import math

import pytest
import torch

from vmemkv.runtime.attention import (BackendUnavailableError, PagedLayerView, UnsupportedError,
                                      VMemLayerView, fastest_backend, get_backend)

CPU_BACKENDS = ("reference", "sdpa", "cpu-varlen")


def fp64_attention(q, k, v, scale, softcap=None):
    """softmax(softcap(q k^T * scale), bottom-right causal) v in fp64; q [T,H,D], k, v [S,Hkv,D]."""
    t, h, _ = q.shape
    s, hkv, _ = k.shape
    k = k.double().repeat_interleave(h // hkv, 1)
    v = v.double().repeat_interleave(h // hkv, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = torch.arange(s).unsqueeze(0) <= torch.arange(t).unsqueeze(1) + (s - t)
    return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)


def one_request(kind, ctx, heads, kv_heads, head_dim, dtype, block_size=4):
    """A batch of one prefill of ``ctx`` tokens (query_len == context_len) in slot 1 / shuffled
    blocks; returns (q, view factory, k, v) with k, v the request's [ctx, Hkv, D] values."""
    g = torch.Generator().manual_seed(31)
    k = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(ctx, heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor([ctx]), torch.tensor([ctx])
    if kind == "vmem":
        kc = torch.full((2, ctx + 3, kv_heads, head_dim), math.nan, dtype=dtype)
        vc = kc.clone()
        kc[1, :ctx], vc[1, :ctx] = k, v
        return q, lambda **kw: VMemLayerView(kc, vc, torch.tensor([1]), *lens, **kw), k, v
    blocks = -(-ctx // block_size)
    kp = torch.full((blocks + 2, block_size, kv_heads, head_dim), math.nan, dtype=dtype)
    vp = kp.clone()
    ids = list(range(blocks + 1, 1, -1))
    for b, blk in enumerate(ids):
        n = min(block_size, ctx - b * block_size)
        kp[blk, :n], vp[blk, :n] = k[b * block_size:b * block_size + n], v[b * block_size:b * block_size + n]
    table = torch.tensor([ids], dtype=torch.int32)
    return q, lambda **kw: PagedLayerView(kp, vp, table, *lens, **kw), k, v


@pytest.mark.parametrize("kind", ["vmem", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_scale_prefill_is_nan_free_and_exact_on_every_cpu_backend(kind, dtype):
    # a whole-prompt prefill (query_len == context_len) took SDPA's is_causal kernel, which
    # returned NaN rows for a negative scale (a scale check_scalars accepts)
    q, view, k, v = one_request(kind, 6, 4, 2, 8, dtype)
    want = fp64_attention(q, k, v, -0.4)
    for name in CPU_BACKENDS:
        out = get_backend(name).forward(q, view(), scale=-0.4)
        assert not out.isnan().any(), name
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert (out.double() - want).abs().max().item() < tol, name


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_huge_softcap_in_fp16_is_no_cap_on_sdpa(kind):
    # scores / 1e30 underflowed to 0 in fp16: every weight was uniform (error ~3)
    q, view, k, v = one_request(kind, 9, 6, 2, 16, torch.float16)
    want = fp64_attention(q, k, v, 2.0 / 4, softcap=1e30)
    assert (want - fp64_attention(q, k, v, 2.0 / 4)).abs().max().item() < 1e-12
    for name in CPU_BACKENDS:
        out = get_backend(name).forward(q, view(softcap=1e30), scale=2.0 / 4)
        assert (out.double() - want).abs().max().item() < 1e-2, name


def test_fp16_softcap_matches_fp64_on_sdpa_for_every_cap_size():
    q, view, k, v = one_request("vmem", 9, 6, 2, 16, torch.float16)
    for cap in (1e-6, 50.0, 1e6):
        out = get_backend("sdpa").forward(q, view(softcap=cap), scale=0.5)
        assert (out.double() - fp64_attention(q, k, v, 0.5, cap)).abs().max().item() < 1e-2, cap


@pytest.mark.parametrize("options", [{"dtype": torch.float64},
                                     {"dtype": torch.float32, "kv_dtype": torch.float64}])
def test_fastest_backend_names_the_dtype_no_backend_takes(options):
    # was BackendUnavailableError "attention backend 'sdpa' is unavailable: " (no reason; sdpa is)
    with pytest.raises(UnsupportedError) as err:
        fastest_backend("paged", "cpu", **options)
    assert not isinstance(err.value, BackendUnavailableError)
    assert "float64" in str(err.value) and "sdpa" in str(err.value)
    assert "cpu-varlen" in str(err.value)


def _empty_views(dtype):
    none = torch.zeros(0, dtype=torch.int64)
    kc = torch.zeros(2, 8, 2, 16, dtype=dtype)
    return (VMemLayerView(kc, kc.clone(), none, none, none),
            PagedLayerView(kc, kc.clone(), torch.zeros(0, 3, dtype=torch.int32), none, none))


def test_an_empty_batch_returns_no_rows_on_every_backend_flash_included():
    from vmemkv.runtime.attention.flash import FlashBackend

    class FlashOnTheCpu(FlashBackend):   # flash's dispatch, reachable without a GPU
        name = "flash-on-cpu"
        devices = frozenset({"cpu", "cuda"})

    q = torch.zeros(0, 4, 16, dtype=torch.float16)
    for backend in (FlashOnTheCpu(), *(get_backend(n) for n in CPU_BACKENDS)):
        for view in _empty_views(torch.float16):   # flash: IndexError / ValueError (max of [])
            out = backend.forward(q, view)
            assert out.shape == (0, 4, 16) and out.dtype == torch.float16, backend.name


@pytest.mark.parametrize("options, named", [
    ({"work_units": "2"}, "work_units"), ({"sdpa_above_tokens": 2.5}, "sdpa_above_tokens"),
    ({"work_units": True}, "work_units"), ({"split_min_keys": None}, "split_min_keys")])
def test_cpu_varlen_options_of_the_wrong_type_are_refused_by_name(options, named):
    # "2" and None were bare TypeErrors ('<' not supported); 2.5 and True were taken
    with pytest.raises(UnsupportedError, match=named):
        get_backend("cpu-varlen", **options)


def test_an_unknown_backend_option_is_refused_naming_what_the_backend_takes():
    # benchmarks' "sdpa:work_units=1": a bare TypeError from the constructor
    with pytest.raises(UnsupportedError, match=r"'sdpa' takes options none; got \['work_units'\]"):
        get_backend("sdpa", work_units=1)
    with pytest.raises(UnsupportedError, match="split_min_keys.*got \\['wrok_units'\\]"):
        get_backend("cpu-varlen", wrok_units=1)
    assert get_backend("cpu-varlen", work_units=1, split_min_keys=8).split_min_keys == 8


def test_fastest_backend_skips_a_backend_without_the_models_layer_features(monkeypatch):
    # as on a CUDA machine with flash-attn installed: it has no sliding window and no soft-cap,
    # so a Mistral / Gemma 2 model that got it had every windowed layer refused
    from vmemkv.runtime.attention import registry
    from vmemkv.runtime.attention.base import Availability
    monkeypatch.setattr(registry, "availability", lambda name: Availability(True))
    half = torch.float16
    assert fastest_backend("vmem", "cuda", dtype=half) == "flash-attn"
    assert fastest_backend("vmem", "cuda", dtype=half, features=frozenset({"window"})) == "flash"
    assert fastest_backend("paged", "cuda", 256, dtype=half, features={"softcap"}) == "flash"
    assert fastest_backend("vmem", "cpu", features={"window", "softcap"}) == "cpu-varlen"
    with pytest.raises(UnsupportedError, match=r"implements no \['sliding'\]"):
        fastest_backend("vmem", "cpu", features={"sliding"})


def test_the_engine_asks_for_a_backend_with_its_models_window_and_softcap():
    """engine.py passes the model's layer features to ``fastest_backend``: a Gemma 2 (window
    and soft-cap) asks for both, a Mistral with a window for it, Llama for neither."""
    from vmemkv.runtime.engine.config import attention_needs
    from vmemkv.runtime.engine.engine import Engine
    from vmemkv.runtime.models import build_model
    from transformers import Gemma2Config, Gemma2ForCausalLM
    gemma2 = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
        attn_logit_softcapping=50.0)).eval()
    for model, features in ((build_model("tiny-llama", seed=0), set()),
                            (build_model("tiny-mistral-swa", seed=0), {"window"}),
                            (gemma2, {"window", "softcap"})):
        with Engine(model, cache="vmem", max_batch=2, max_context=64) as engine:
            needs = attention_needs(engine.model, engine.cache_config)
            assert needs["features"] == frozenset(features)
