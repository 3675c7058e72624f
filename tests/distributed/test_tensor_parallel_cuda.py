"""Tensor parallelism on GPUs (GPU tests, run by benchmarks/gpu_check.sh). NONE OF THESE HAS EVER
RUN ON HARDWARE when this was written (no GPU on the development machine).

Two CUDA devices: TP=2 greedy equal to transformers (up to a near-tie, as tests/engine's CUDA
tests), half the KV bytes per rank, a killed rank, a wrong shard refused. One CUDA device (the
only kind this project is lent): two ranks sharing cuda:0 with activations over gloo (NCCL
refuses one GPU twice), which runs the whole CUDA start-up, per-rank CUDA caches, the model
passed by CUDA IPC and the sharded self-check; and a one-rank NCCL activation group.
"""
from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch
import torch.distributed as dist

from vmemkv.runtime.distributed import TensorParallelError, TensorParallelMismatchError, worker
from vmemkv.runtime.distributed.placement import RankPlacement
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

from ..engine.conftest import prompts, tokens
from ..engine.near_tie import hf_greedy_with_margins, near_tie_mismatches
from .test_shard_check import wrong_column_split

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
CACHES = {"vmem": dict(cache="vmem"), "paged": dict(cache="paged", block_size=16)}


class SharedGpu(RankPlacement):
    """Every rank on cuda:0, activations over gloo (which sums CUDA tensors through the host)."""

    @property
    def activation_backend(self) -> str:
        return "gloo"


def _greedy_on_cuda(size: int, cache: str, batch, new: int, **options):
    model = build_model("tiny-llama", seed=0, device="cuda")
    with Engine(model, max_batch=4, max_context=128, tensor_parallel_size=size,
                check_integrity=True, **CACHES[cache], **options) as engine:
        out = engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True))
        per_rank = engine.kv.manager.stats().total_tokens * engine.cache_config.bytes_per_token
        return tokens(out), per_rank, str(engine.kv.cache.config.torch_device)


def _reference(batch, new: int):
    reference = build_model("tiny-llama", seed=0, device="cuda")
    reference.generation_config.eos_token_id = None
    return hf_greedy_with_margins(reference, batch, new)


@two_gpus
@pytest.mark.parametrize("cache", list(CACHES))
def test_tp2_on_two_gpus_is_greedy_equal_to_transformers_with_half_the_kv_per_rank(cache):
    batch = prompts(5, 1, 40, seed=1)
    one, bytes1, _ = _greedy_on_cuda(1, cache, batch, 10)
    two, bytes2, device = _greedy_on_cuda(2, cache, batch, 10)
    want, margins = _reference(batch, 10)
    assert device == "cuda:0" and bytes2 * 2 == bytes1
    assert near_tie_mismatches(two, want, margins) == near_tie_mismatches(one, want, margins) == []


@two_gpus
def test_a_rank_killed_on_cuda_raises_within_the_timeout_and_leaves_no_process():
    engine = Engine(build_model("tiny-llama", seed=0, device="cuda"), max_batch=2,
                    max_context=128, tensor_parallel_size=2, self_check=False, tp_timeout_s=10.0)
    pids = engine.tp.rank_pids
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=50))
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError):
        for _ in range(50):
            engine.step()
    assert not multiprocessing.active_children()
    engine.close()


@two_gpus
def test_a_wrong_shard_on_cuda_refuses_construction(monkeypatch):
    monkeypatch.setattr(worker, "shard_model", wrong_column_split(worker.shard_model))
    with pytest.raises(TensorParallelMismatchError, match="sharded forward differs"):
        Engine(build_model("tiny-llama", seed=0, device="cuda"), max_batch=2, max_context=64,
               tensor_parallel_size=2)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("cache", list(CACHES))
def test_two_ranks_sharing_one_gpu_run_the_cuda_path_and_are_greedy_equal(cache, monkeypatch):
    from vmemkv.runtime.engine import tensor_parallel
    monkeypatch.setattr(tensor_parallel, "placement_of",
                        lambda cfg, device: SharedGpu(("cuda:0",) * cfg.tensor_parallel_size))
    batch = prompts(3, 1, 30, seed=2)
    two, bytes2, device = _greedy_on_cuda(2, cache, batch, 8)    # self-check on: it runs too
    one, bytes1, _ = _greedy_on_cuda(1, cache, batch, 8)
    want, margins = _reference(batch, 8)
    assert device == "cuda:0" and bytes2 * 2 == bytes1
    assert near_tie_mismatches(two, want, margins) == near_tie_mismatches(one, want, margins) == []
    assert not multiprocessing.active_children()


def test_a_one_rank_nccl_activation_group_sums_on_the_gpu(monkeypatch):
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    from vmemkv.runtime.distributed.group import RankGroup, leave_group, open_activation_group
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)          # restored (unset) after the test
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        rank = RankGroup(0, 1, step_timeout_s=10.0)
        open_activation_group(rank, "nccl", torch.device("cuda", 0))
        t = torch.arange(4.0, device="cuda")
        rank.all_reduce_(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0] and rank.collectives == 1
    finally:
        leave_group()
