"""8-bit and 16-bit K/V under tensor parallelism (CPU, gloo): each rank stores its KV heads in the
engine's kv_cache_dtype with those heads' columns of the scales, so TP=2 gives TP=1's tokens in
half the bytes per rank, swapped K/V included; first-write scales are the first request's, not
the construction's sharded check's; the check compares against the same rounding on one
process, and refuses a rank whose scales are wrong."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from vmemkv.runtime.distributed import TensorParallelMismatchError, worker
from vmemkv.runtime.distributed.sharding import kv_head_span, rank_kv_scales
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.kv_dtype import KVScales

from ..engine.conftest import model
from .test_tensor_parallel import workload

# per rank: 8-bit K/V are a quarter of fp32's, so this is as tight as test_tensor_parallel's
# 24 KiB fp32 paged cache: the 12 sequences cannot all run at once
PAGED = dict(cache="paged", block_size=4, preemption="swap", swap_bytes=1 << 20)


def run(n, dtype, cache_bytes, **options):
    """Greedy tokens (2 samples per prompt), the stats, rank 0's scales and KV bytes per token."""
    with Engine(model("tiny-llama"), max_batch=4, max_context=1024, prefix_sharing=True,
                tensor_parallel_size=n, kv_cache_dtype=dtype, cache_bytes=cache_bytes,
                **PAGED, **options) as engine:
        out = engine.generate(workload(), SamplingParams(max_new_tokens=12, n=2))
        return ([[c.token_ids for c in o.outputs] for o in out], engine.stats(),
                engine.cache_config.kv_scales, engine.cache_config.bytes_per_token)


@pytest.mark.parametrize("dtype, options", [("int8", dict(kv_scales="calibrate")),
                                            ("bf16", {})])
def test_tp2_with_a_kv_cache_dtype_gives_tp1s_tokens_in_half_the_bytes_per_rank(dtype, options):
    cache_bytes = 6144 if dtype == "int8" else 12288
    one, stats1, scales1, per_token1 = run(1, dtype, cache_bytes, **options)
    two, stats2, scales2, per_token2 = run(2, dtype, cache_bytes // 2, **options)
    assert one == two
    assert stats1.num_swap_preemptions > 0 and stats2.num_swap_preemptions > 0   # swapped bytes
    assert per_token2 * 2 == per_token1            # each rank: half the heads, same encoding
    if scales1 is not None:                        # rank 0 holds KV head 0's column
        assert scales2 == KVScales(tuple(r[:1] for r in scales1.k), tuple(r[:1] for r in scales1.v))


def test_first_write_scales_under_tp_are_the_first_requests_not_the_shard_checks():
    """The sharded self-check writes the engine's caches first; its prompt must not fix the
    scales. Every rank's are unfixed after it, and the first request fixes them as on one
    process: TP=2 gives TP=1's tokens and rank 0 holds the columns of TP=1's scales."""
    def first_write(n, cache_bytes):
        with Engine(model("tiny-llama"), max_batch=4, max_context=1024, tensor_parallel_size=n,
                    kv_cache_dtype="fp8_e4m3", cache_bytes=cache_bytes, **PAGED) as engine:
            assert engine.kv_scales_source == "first-write"
            table = engine.kv.cache.kv_scales
            assert table.fixed == [False, False] and float(table.k.max()) == 1.0   # unfixed
            out = engine.generate(workload(), SamplingParams(max_new_tokens=12, n=2))
            return [[c.token_ids for c in o.outputs] for o in out], table.k.clone()
    one, k_one = first_write(1, 6144)
    two, k_two = first_write(2, 3072)
    assert one == two
    assert torch.allclose(k_two, k_one[:, :1], rtol=1e-5)   # KV head 0's column


def test_each_rank_takes_its_kv_heads_columns_split_or_replicated():
    config = model("tiny-llama").config           # 2 KV heads
    scales = KVScales.of([[1.0, 2.0]] * 2, [[3.0, 4.0]] * 2)
    assert [kv_head_span(config, r, 2) for r in range(2)] == [slice(0, 1), slice(1, 2)]
    assert [kv_head_span(config, r, 4) for r in range(4)] == [slice(0, 1), slice(0, 1),
                                                              slice(1, 2), slice(1, 2)]
    assert [rank_kv_scales(scales, config, r, 4).k[0] for r in range(4)] == [(1.0,), (1.0,),
                                                                            (2.0,), (2.0,)]
    assert rank_kv_scales(scales, config, 1, 2) == KVScales(((2.0,),) * 2, ((4.0,),) * 2)
    assert rank_kv_scales(scales, config, 0, 1) == scales
    assert rank_kv_scales(None, config, 0, 2) is None


def test_a_rank_with_wrong_scales_fails_the_sharded_check(monkeypatch):
    """Rank 0 (this process; the spawned rank is right) takes a tenth of its scales: its K/V
    saturate, and the check against int8 on one process refuses the engine."""
    def tenth(scales, config, rank, world):
        right = rank_kv_scales(scales, config, rank, world)
        return KVScales.of([[s / 10 for s in r] for r in right.k], [[s / 10 for s in r] for r in right.v])
    monkeypatch.setattr(worker, "rank_kv_scales", tenth)
    with pytest.raises(TensorParallelMismatchError, match=r"sharded forward differs"):
        Engine(model("tiny-llama"), max_batch=2, max_context=64, tensor_parallel_size=2,
               kv_cache_dtype="int8", kv_scales="calibrate")
    assert not multiprocessing.active_children()


def test_unfix_forgets_first_write_scales_and_keeps_given_ones():
    from vmemkv.runtime.kv_dtype import ScaleTable, kv_encoding
    encoding = kv_encoding("int8", torch.float32)
    k, v = torch.full((3, 2, 4), 2.54), torch.full((3, 2, 4), 1.27)   # [tokens, heads, dim]
    first = ScaleTable(encoding, 2, 2, torch.device("cpu"))
    first.encode(0, k, v)
    assert first.fixed == [True, False] and first.k[0].tolist() == pytest.approx([0.02, 0.02])
    first.unfix()
    assert first.fixed == [False, False] and first.k.tolist() == [[1.0, 1.0]] * 2
    given = ScaleTable(encoding, 2, 2, torch.device("cpu"), KVScales.of([[0.5, 0.5]] * 2,
                                                                        [[0.25, 0.25]] * 2))
    given.unfix()
    assert given.fixed == [True, True] and given.k.tolist() == [[0.5, 0.5]] * 2
