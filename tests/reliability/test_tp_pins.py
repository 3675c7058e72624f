"""Pins on tensor parallelism's pure parts, no process started: the shards of a model summed as
the ranks sum them give the model's own logits (threads stand in for ranks), where ranks are
placed and what is refused (runtime/distributed/placement.py, sharding.py), how a failed
collective and a rank's end are worded, and the broadcast and gather frames (group.py, over a
one-process gloo group)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime.distributed import TensorParallelConfigError
from vmemkv.runtime.distributed.placement import place_ranks
from vmemkv.runtime.distributed.sharding import (check_tensor_parallel, kv_heads_per_rank,
                                                 shard_model)
from vmemkv.runtime.models import model_config


def _biased_tiny_llama():
    """tiny-llama (4 heads, 2 KV heads, MLP width 128) with every projection biased, so the
    row-parallel biases (o_proj, down_proj) are exercised; seeded random weights, eager attention."""
    from transformers import AutoModelForCausalLM
    config = model_config("tiny-llama")
    config.attention_bias, config.mlp_bias = True, True
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for_bias = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in for_bias.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)          # from_config leaves biases zero
    return for_bias.eval()


def _threaded_all_reduce(world: int):
    """(all_reduce functions, one per rank, that sum a tensor over ``world`` threads in place;
    their barrier, which a failing thread breaks so the others stop waiting)."""
    slots, barrier = [None] * world, threading.Barrier(world, timeout=30)

    def for_rank(rank):
        def all_reduce(t):
            slots[rank] = t
            barrier.wait()
            total = sum(s.clone() for s in slots)
            barrier.wait()
            t.copy_(total)
        return all_reduce
    return [for_rank(r) for r in range(world)], barrier


@pytest.mark.parametrize("world", [2, 4])   # 4: each KV head replicated on two ranks
def test_shards_summed_across_ranks_give_the_full_models_logits(world):
    model = _biased_tiny_llama()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        expected = model(ids).logits
    reduces, barrier = _threaded_all_reduce(world)
    shards = [shard_model(model, r, world, reduces[r]) for r in range(world)]
    logits, errors = [None] * world, []

    def run(rank):
        try:
            with torch.no_grad():
                logits[rank] = shards[rank](ids).logits
        except BaseException as error:   # noqa: BLE001 -- reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for rank in range(world):
        torch.testing.assert_close(logits[rank], expected, rtol=1e-4, atol=1e-4)


def test_ranks_past_the_kv_heads_each_hold_one_replicated_kv_head():
    assert kv_heads_per_rank(model_config("tiny-llama"), 2) == 1
    assert kv_heads_per_rank(model_config("tiny-llama"), 4) == 1     # 2 KV heads, 4 ranks


def _config_only(heads: int, kv: int, width: int):
    return SimpleNamespace(config=SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                                                  intermediate_size=width))


@pytest.mark.parametrize("heads, kv, width, world, match", [
    (6, 2, 96, 3, "tensor_parallel_size 3 neither divides the model's 2 KV heads nor is a multiple"),
    (4, 2, 130, 4, r"does not divide the model's MLP width \(intermediate_size=130\)"),
])
def test_sizes_that_cannot_split_kv_heads_or_the_mlp_exactly_are_refused(heads, kv, width, world,
                                                                         match):
    with pytest.raises(TensorParallelConfigError, match=match):
        check_tensor_parallel(_config_only(heads, kv, width), world)


@pytest.mark.parametrize("device, world, devices, visible, match", [
    ("cuda:2", 2, None, 2, "the model is on cuda:2 but 2 CUDA devices are visible"),
    ("cuda:0", 2, ["cuda:0", "cuda:1", "cuda:2"], 4,
     r"tp_devices names 3 device\(s\) .* but tensor_parallel_size is 2"),
])
def test_placements_that_cannot_run_are_refused(device, world, devices, visible, match):
    with pytest.raises(TensorParallelConfigError, match=match):
        place_ranks(device, world, devices, visible_cuda=visible)


def test_a_model_on_plain_cuda_is_on_cuda_0_for_a_device_list():
    assert place_ranks("cuda", 2, ["cuda:0", "cuda:1"], visible_cuda=2).devices == (
        "cuda:0", "cuda:1")


@pytest.mark.parametrize("elapsed_s, timeout_s, words", [
    (1.0, 2.0, "failed after 1.00 s, before its 2 s timeout"),
    (1.95, 2.0, "waited past 2 s"),                  # within the backend clock's 5%
    (3.0, None, "failed after 3.00 s, before its 3.1536e+09 s timeout"),   # an idle wait
])
def test_a_failed_wait_is_called_a_timeout_only_once_it_reached_its_limit(elapsed_s, timeout_s,
                                                                           words):
    from vmemkv.runtime.distributed.group import _how_it_ended
    assert words in _how_it_ended(elapsed_s, timeout_s)


@pytest.mark.parametrize("exitcode, fate", [
    (0, "rank 1 (pid 4242) exited with code 0"),
    (3, "rank 1 (pid 4242) exited with code 3"),
    (-9, "rank 1 (pid 4242) was killed by SIGKILL"),
    (None, None),                                    # never started
])
def test_a_rank_that_ended_is_named_with_its_exit_code_or_signal(exitcode, fate):
    from vmemkv.runtime.distributed.group import SpawnedRanks
    ranks = object.__new__(SpawnedRanks)             # no process: only its end is read
    ranks.procs = [SimpleNamespace(pid=4242, exitcode=exitcode, is_alive=lambda: False)]
    assert ranks.fate_of(1) == fate


def test_a_decoder_without_the_llama_projections_is_refused_naming_them():
    from vmemkv.runtime.models import build_model
    model = build_model("tiny-llama", seed=0)
    model.model.layers[1].mlp.gate_proj = torch.nn.Identity()
    with pytest.raises(TensorParallelConfigError, match="llama layer 1 has no gate_proj Linear"):
        check_tensor_parallel(model, 2)


@pytest.fixture
def one_rank_group():
    """A RankGroup over a one-process gloo group (an in-memory store), torn down after."""
    import torch.distributed as dist
    from vmemkv.runtime.distributed.group import RankGroup
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield RankGroup(0, 1, step_timeout_s=30.0)
    finally:
        dist.destroy_process_group()


def _pickle_of(num_bytes: int) -> bytes:
    """A bytes object whose pickle is exactly ``num_bytes`` long."""
    import pickle
    overhead = next(k for k in range(64) if len(pickle.dumps(b"x" * (num_bytes - k))) == num_bytes)
    return b"x" * (num_bytes - overhead)


def test_a_plan_one_byte_past_the_frame_takes_a_second_broadcast(one_rank_group):
    from vmemkv.runtime.distributed.group import INLINE_BYTES
    one_rank_group.broadcast(_pickle_of(INLINE_BYTES))
    assert one_rank_group.collectives == 1                  # fits the frame
    one_rank_group.broadcast(_pickle_of(INLINE_BYTES + 1))
    assert one_rank_group.collectives == 3                  # the frame, then the rest


def test_a_gather_larger_than_its_frame_is_refused_naming_the_size(one_rank_group):
    from vmemkv.runtime.distributed.group import INLINE_BYTES
    assert one_rank_group.gather({"pages": 3}) == [{"pages": 3}]
    with pytest.raises(ValueError, match=f"state gather of {INLINE_BYTES + 1} bytes exceeds the "
                                         f"{INLINE_BYTES}-byte frame"):
        one_rank_group.gather(_pickle_of(INLINE_BYTES + 1))
    assert one_rank_group.collectives == 1                  # nothing sent for it
