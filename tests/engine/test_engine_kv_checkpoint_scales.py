"""8-bit KV scales a checkpoint carries (``k_scale`` / ``v_scale`` / ``kv_scale`` on the
attention modules, as transformers holds a compressed-tensors fp8 checkpoint's): the engine's
cache uses them unless the user gave ``kv_scales``, generates what the same scales given by
hand do, keys its prefix cache by them, and refuses bad ones by name before anything is built."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv_dtype import KVScales
from vmemkv.runtime.models import build_model
from vmemkv.scheduler.managers.prefix import namespace_root

from ..vmem_only_options import options_for
from .conftest import model, prompts, tokens

OPTIONS = dict(max_batch=2, max_context=64, block_size=4, page_bytes=4096, self_check=False)
# tiny-llama: 2 layers, 2 KV heads. Layer 0 carries k_scale / v_scale as compressed-tensors
# registers them (Parameters of shape [1] in the model's dtype; bf16 here, exact values), layer 1
# one older-style kv_scale per KV head.
K = ((0.03125, 0.03125), (0.05, 0.02))
V = ((0.015625, 0.015625), (0.05, 0.02))


def with_scales(**by_layer) -> torch.nn.Module:
    """tiny-llama (the weights of ``model()``) with scale buffers on its attention modules, as
    a loaded checkpoint holds them: ``by_layer`` maps "l0" / "l1" to {attribute: tensor}."""
    m = build_model("tiny-llama", seed=0)
    for key, attrs in by_layer.items():
        attn = m.model.layers[int(key[1:])].self_attn
        for name, value in attrs.items():
            if isinstance(value, torch.nn.Parameter):
                attn.register_parameter(name, value)
            else:
                attn.register_buffer(name, torch.as_tensor(value, dtype=torch.float32))
    return m


def checkpoint_model() -> torch.nn.Module:
    def param(x):
        return torch.nn.Parameter(torch.tensor([x], dtype=torch.bfloat16), requires_grad=False)
    return with_scales(l0={"k_scale": param(K[0][0]), "v_scale": param(V[0][0])},
                       l1={"kv_scale": [0.05, 0.02]})


def test_the_checkpoints_scales_are_the_caches_and_give_the_tokens_of_the_same_kv_scales():
    batch = prompts(2, 12, 20, seed=3)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs, tags = {}, {}
    for source, m, given in (("checkpoint", checkpoint_model(), None),
                             ("user", model(), KVScales.of(K, V))):
        with Engine(m, kv_cache_dtype="fp8_e4m3", kv_scales=given, **OPTIONS) as engine:
            assert engine.kv_scales_source == source
            scales = engine.kv.cache.kv_scales
            assert scales.fixed == [True, True]          # before any write
            assert torch.equal(scales.k, torch.tensor(K)) and torch.equal(scales.v, torch.tensor(V))
            outs[source] = tokens(engine.generate(batch, params))
            tags[source] = engine.cache_config.prefix_tag
    assert outs["checkpoint"] == outs["user"]
    assert tags["checkpoint"] == tags["user"] == f"fp8_e4m3/{KVScales.of(K, V).digest}"


@pytest.mark.parametrize("scheme, kv_cache_dtype, ratio", [
    (None, "int8", 448 / 127),                   # vLLM's convention: fp8 e4m3 scales
    (None, "fp8_e5m2", 448 / 57344),
    ({"type": "int", "num_bits": 8}, "int8", 1.0),
    ({"type": "int", "num_bits": 8}, "fp8_e4m3", 127 / 448),
    ({"quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 8}}}, "int8",
     448 / 127),
])
def test_checkpoint_scales_keep_their_clip_point_in_another_8bit_format(scheme, kv_cache_dtype,
                                                                        ratio):
    """scale x the checkpoint format's max (its kv_cache_scheme; none: fp8 e4m3) = the cache's
    scale x its encoding's max: fp8 scales in an int8 cache do not saturate at 127."""
    m = checkpoint_model()
    if scheme is not None:
        m.config.quantization_config = (scheme if "quantization_config" in scheme
                                        else {"kv_cache_scheme": scheme})
    with Engine(m, kv_cache_dtype=kv_cache_dtype, **OPTIONS) as engine:
        assert engine.kv_scales_source == "checkpoint"
        want = KVScales.of([[s * ratio for s in r] for r in K], [[s * ratio for s in r] for r in V])
        assert engine.cache_config.kv_scales == want
        assert torch.equal(engine.kv.cache.kv_scales.k, torch.tensor(want.k))


def test_user_scales_win_over_the_checkpoints_and_16_bit_ignores_them(caplog):
    mine = KVScales.of([[0.5, 0.5]] * 2, [[0.25, 0.25]] * 2)
    with caplog.at_level("INFO", logger="vmemkv.engine"):
        with Engine(checkpoint_model(), kv_cache_dtype="fp8_e4m3", kv_scales=mine, **OPTIONS) as e:
            assert e.kv_scales_source == "user" and e.cache_config.kv_scales == mine
            assert e.kv.cache.kv_scales.k.tolist() == [[0.5, 0.5]] * 2
    assert [r.getMessage() for r in caplog.records if r.name == "vmemkv.engine"] == [
        "kv_cache_dtype fp8_e4m3: scales from user"]
    with Engine(checkpoint_model(), kv_cache_dtype="bf16", **OPTIONS) as e:
        assert e.kv_scales_source is None and e.kv.cache.kv_scales is None
    with Engine(model(), kv_cache_dtype="fp8_e4m3", **OPTIONS) as e:
        assert e.kv_scales_source == "first-write" and e.kv.cache.kv_scales.fixed == [False] * 2


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_different_checkpoint_scales_never_share_a_prefix_key(cache):
    """The manager's chain root (every prefix key is chained on it) carries the scales'
    digest: caches on different checkpoint scales have different roots, so no common key."""
    roots = {}
    for s in (0.03, 0.04):
        m = with_scales(l0={"kv_scale": s}, l1={"kv_scale": s})
        with Engine(m, cache=cache, kv_cache_dtype="fp8_e4m3", prefix_sharing=True,
                    **options_for(cache, **OPTIONS)) as engine:
            tag = engine.kv.manager.model.kv_encoding
            assert tag == f"fp8_e4m3/{KVScales.of([[s, s]] * 2, [[s, s]] * 2).digest}"
            roots[s] = namespace_root(None, tag)
    assert roots[0.03] != roots[0.04]


@pytest.mark.parametrize("by_layer, message", [
    ({"l0": {"k_scale": [1.0, 1.0, 1.0], "v_scale": 1.0}, "l1": {"kv_scale": 1.0}},
     r"model\.layers\.0\.self_attn\.k_scale has shape \[3\]; .* scalar or \[2\]"),
    ({"l0": {"kv_scale": [[1.0, 1.0]]}, "l1": {"kv_scale": 1.0}},
     r"model\.layers\.0\.self_attn\.kv_scale has shape \[1, 2\]"),
    ({"l0": {"kv_scale": 1.0}, "l1": {"k_scale": [1.0, float("nan")], "v_scale": 1.0}},
     r"model\.layers\.1\.self_attn\.k_scale\[1\] must be a finite number > 0, got nan"),
    ({"l0": {"kv_scale": 1.0}, "l1": {"k_scale": 1.0, "v_scale": 0.0}},
     r"model\.layers\.1\.self_attn\.v_scale\[0\] must be a finite number > 0, got 0\.0"),
    ({"l0": {"kv_scale": -1.0}, "l1": {"kv_scale": 1.0}},
     r"model\.layers\.0\.self_attn\.kv_scale\[0\] must be a finite number > 0, got -1\.0"),
    ({"l0": {"kv_scale": 1.0}},
     r"carries KV scales for layers \[0\] but not for layers \[1\]"),
    ({"l0": {"k_scale": 1.0}, "l1": {"kv_scale": 1.0}},
     r"model\.layers\.0\.self_attn carries k_scale; .* k_scale and v_scale, or kv_scale alone"),
    ({"l0": {"kv_scale": 1.0, "k_scale": 1.0, "v_scale": 1.0}, "l1": {"kv_scale": 1.0}},
     r"model\.layers\.0\.self_attn carries k_scale, v_scale, kv_scale; "),
], ids=["shape", "shape-2d", "nan", "zero", "negative", "missing-layer", "half-pair", "both"])
def test_bad_checkpoint_scales_are_refused_by_name_before_anything_is_built(by_layer, message):
    m = with_scales(**by_layer)
    before = m.config._attn_implementation
    with pytest.raises(CacheConfigError, match=message):
        Engine(m, kv_cache_dtype="int8", **OPTIONS)
    assert m.config._attn_implementation == before      # the model is left as it was
    with Engine(m, kv_cache_dtype="int8", kv_scales=KVScales.of(K, V), **OPTIONS) as engine:
        assert engine.kv_scales_source == "user"         # the user's scales are not read past


def test_a_checkpoint_scheme_other_than_8bit_is_refused_by_name():
    m = checkpoint_model()
    m.config.quantization_config = {"kv_cache_scheme": {"type": "float", "num_bits": 4}}
    with pytest.raises(CacheConfigError, match=r"kv_cache_scheme is 'float' with 4 bits"):
        Engine(m, kv_cache_dtype="fp8_e4m3", **OPTIONS)
