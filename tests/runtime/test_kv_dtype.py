"""kv_cache_dtype: the codec's round-trip error bounds, the scales (given, or fixed at a layer's
first write), the refusals by name before anything is built, capacity in the same bytes, and
the prefix cache's keys naming the encoding."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.engine.config import EngineConfig
from vmemkv.runtime.engine.errors import EngineConfigError
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv import make_kv
from vmemkv.runtime.kv_dtype import KVScales, kv_encoding
from vmemkv.scheduler.managers.prefix import namespace_root

from ..vmem_only_options import options_for

# |decoded - x| for |x| <= max * scale: (relative bound of a normal, absolute bound near 0 / s)
BOUNDS = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -10), "fp8_e5m2": (2.0 ** -3, 2.0 ** -17),
          "int8": (0.0, 0.5), "bf16": (2.0 ** -8, 0.0), "fp16": (2.0 ** -11, 2.0 ** -25)}


def config(**kw) -> CacheConfig:
    return CacheConfig(**{**dict(num_layers=2, num_kv_heads=2, head_dim=8, max_batch=2,
                                 max_context=256), **kw})


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(BOUNDS)), st.floats(1e-3, 1e3),
       st.lists(st.floats(-2.0, 2.0, allow_subnormal=False), min_size=16, max_size=16))
def test_round_trip_error_is_within_the_encodings_bound_and_saturates(name, scale, xs):
    """x in units of the encoding's range (8-bit: |x| up to 1.4x its max): the decoded value is
    within the rounding bound of x clamped to the range, so saturates to +-max * scale."""
    enc = kv_encoding(name, torch.float32)
    top = enc.max_value or 60000.0                # fp16/bf16: no scale, no saturation; stay
    s = torch.full((2,), scale if enc.scaled else 1.0)                       # in fp16's range
    spread = 2 ** -0.5 if enc.scaled else 0.5
    x = torch.tensor(xs, dtype=torch.float32).view(4, 2, 2) * top * s.view(1, 2, 1) * spread
    got = enc.dequantize(enc.quantize(x, s), s).float()
    clamped = torch.minimum(x.abs(), torch.tensor(top) * s.view(1, 2, 1)) * x.sign()
    rel, near_zero = BOUNDS[name]
    bound = torch.maximum(rel * clamped.abs(), near_zero * s.view(1, 2, 1)) * (1 + 1e-6) + 1e-30
    assert ((got - clamped).abs() <= bound).all()
    assert enc.quantize(x, s).dtype == enc.storage and enc.storage.itemsize == enc.element_bytes


def test_int8_rounds_to_nearest_and_clamps_to_127():
    enc = kv_encoding("int8", torch.float32)
    s = torch.ones(1)
    x = torch.tensor([[[0.4, 0.6, -1.6, 126.6, 300.0, -300.0]]])
    assert enc.quantize(x, s).tolist() == [[[0, 1, -2, 127, 127, -127]]]


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_scales_are_fixed_by_a_layers_first_write_and_given_ones_are_kept(kind):
    """First write: per KV head amax / max (fp8_e4m3: 448); later writes reuse them (larger
    values saturate); given scales are used as they are."""
    kv = make_kv(config(kv_cache_dtype="fp8_e4m3"), kind, **options_for(kind, page_bytes=4096))
    kv.manager.allocate(0, 4)
    kv.execute(kv.manager.take_ops())
    kv.begin_step([(0, 0, 2)])
    k = torch.zeros(2, 2, 8)
    k[0, 0, 3], k[1, 1, 5] = 8.96, -4.48            # amax per head: 8.96, 4.48
    kv.write(0, k, k)
    assert kv.kv_scales.k[0].tolist() == pytest.approx([0.02, 0.01])
    kv.begin_step([(0, 2, 2)])
    kv.write(0, k * 100, k)                          # not a first write: scales stay
    assert kv.kv_scales.k[0].tolist() == pytest.approx([0.02, 0.01])
    stored, _ = kv.read(0, 0, 4)
    assert stored[2:].float().abs().max().item() == 448.0   # saturated, not inf / NaN
    assert kv.kv_scales.fixed == [True, False]
    given = KVScales.of([[0.5, 0.25]] * 2, [[1.0, 2.0]] * 2)
    cache = make_kv(config(kv_cache_dtype="int8", kv_scales=given), kind,
                    **options_for(kind, page_bytes=4096)).cache
    assert cache.kv_scales.fixed == [True, True] and cache.kv_scales.v[1].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("kw, field", [
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="int8", kv_scales=([[1.0, 1.0]], [[1.0, 1.0]] * 2)), "kv_scales.k"),
    (dict(kv_cache_dtype="int8", kv_scales=([[1.0, 1.0]] * 2, [[1.0]] * 2)), "kv_scales.v"),
    (dict(kv_cache_dtype="fp8_e4m3", kv_scales=([[1.0, 0.0]] * 2, [[1.0, 1.0]] * 2)), "kv_scales.k[0][1]"),
    (dict(kv_cache_dtype="fp8_e5m2", kv_scales=([[1.0, 1.0]] * 2, [[float("nan"), 1.0]] * 2)), "kv_scales.v[0][0]"),
    (dict(kv_cache_dtype="fp8_e5m2", kv_scales=([[1.0, 1.0]] * 2, [[float("inf"), 1.0]] * 2)), "kv_scales.v[0][0]"),
    (dict(kv_cache_dtype="int8", kv_scales=([[1.0, 1e39]] * 2, [[1.0, 1.0]] * 2)), "kv_scales.k[0][1]"),
    (dict(kv_cache_dtype="int8", kv_scales=([[1.0, 1.0]] * 2, [[1e-50, 1.0]] * 2)), "kv_scales.v[0][0]"),
    (dict(kv_cache_dtype="bf16", kv_scales=([[1.0, 1.0]] * 2,) * 2), "kv_scales"),
    (dict(kv_cache_dtype="int8", device="cuda"), "kv_cache_dtype"),
])
def test_bad_encodings_and_scales_are_refused_by_name_before_anything_is_built(kw, field):
    with pytest.raises(CacheConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        config(**kw)


def test_the_engine_config_refuses_an_unknown_kv_cache_dtype_by_name():
    with pytest.raises(EngineConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="e4m3")
    with pytest.raises(EngineConfigError, match="kv_scales"):
        EngineConfig(kv_cache_dtype="auto", kv_scales=([[1.0]], [[1.0]]))


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_the_same_cache_bytes_hold_4x_fp32s_and_2x_fp16s_tokens_in_fp8(kind):
    """Bytes per token follow kv_cache_dtype in the pool the manager plans (pages, blocks)."""
    cache_bytes, held = 2 ** 20, {}
    for model_dtype, kv in ((torch.float32, "auto"), (torch.float16, "auto"),
                            (torch.float32, "fp8_e4m3"), (torch.float16, "int8")):
        c = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, dtype=model_dtype,
                        max_batch=64, max_context=1024, kv_cache_dtype=kv)
        manager = make_kv(c, kind, cache_bytes=cache_bytes, block_size=16,
                          **options_for(kind, page_bytes=64 * 2 ** 10)).manager
        held[model_dtype, kv] = manager.stats().total_tokens
    fp32, fp16 = held[torch.float32, "auto"], held[torch.float16, "auto"]
    assert held[torch.float32, "fp8_e4m3"] == 4 * fp32 == 2 * fp16 == held[torch.float16, "int8"]


def test_prefix_keys_name_the_encoding_and_its_scales():
    """Units stored in different encodings (or under different given scales) never share a
    chain digest; the model's own dtype keeps the keys it always had."""
    tags = {}
    for kw in (dict(), dict(kv_cache_dtype="bf16"), dict(kv_cache_dtype="fp8_e4m3"),
               dict(kv_cache_dtype="fp8_e5m2"),
               dict(kv_cache_dtype="fp8_e4m3", kv_scales=([[1.0, 1.0]] * 2,) * 2),
               dict(kv_cache_dtype="fp8_e4m3", kv_scales=([[1.0, 2.0]] * 2,) * 2)):
        tags[repr(kw)] = config(**kw).model_spec().kv_encoding
    assert tags[repr({})] == "" and len(set(tags.values())) == len(tags)
    roots = {namespace_root("ns", tag) for tag in tags.values()}
    assert len(roots) == len(tags) and namespace_root("ns", "") == namespace_root("ns")


def test_the_simulator_sizes_memory_and_the_kv_read_by_the_kv_cache_dtype():
    from vmemkv.scheduler.errors import ConfigError
    from vmemkv.scheduler.simulator import SimConfig
    fp16, fp8 = SimConfig(), SimConfig(kv_cache_dtype="fp8_e4m3")
    assert fp16.model_spec.bytes_per_token == 2 * fp8.model_spec.bytes_per_token == 131072
    assert fp8.model_spec.params == fp16.model_spec.params      # the weights stay
    assert fp8.make_cost().model.bytes_per_token == 65536
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        SimConfig(kv_cache_dtype="fp4")


def test_a_view_of_an_8bit_cache_without_its_scales_is_refused_by_name():
    import dataclasses
    from vmemkv.runtime.attention import get_backend
    from vmemkv.runtime.attention.errors import AttentionShapeError
    kv = make_kv(config(kv_cache_dtype="int8"), "paged")
    kv.manager.allocate(0, 3)
    kv.execute(kv.manager.take_ops())
    kv.begin_step([(0, 0, 3)])
    kv.write(0, torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    view, q = kv.layer_view(0), torch.randn(3, 4, 8)
    assert get_backend("cpu-varlen").forward(q, view).shape == q.shape
    for bad in (dict(k_scale=None), dict(v_scale=torch.ones(3)), dict(k_scale=torch.ones(2).double())):
        with pytest.raises(AttentionShapeError, match="scale"):
            get_backend("cpu-varlen").forward(q, dataclasses.replace(view, **bad))
