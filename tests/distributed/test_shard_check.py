"""The construction-time check of a tensor-parallel engine: every rank's sharded forward against
the unsharded model on rank 0. A correct shard passes and leaves the caches empty; a wrong
column split makes construction refuse, naming the difference, with no process left."""
from __future__ import annotations

import multiprocessing

import pytest

from vmemkv.runtime.distributed import TensorParallelMismatchError, worker
from vmemkv.runtime.engine import Engine, SamplingParams

from ..engine.conftest import hf_greedy, model, tokens


def wrong_column_split(real):
    """``shard_model`` that gives rank 0 rank 1's MLP columns of layer 0 (patched in rank 0's
    process only: the spawned ranks shard correctly)."""
    def shard(m, rank, world, all_reduce, copy_first=True, device=None):
        out = real(m, rank, world, all_reduce, copy_first, device)
        if rank == 0:
            full = m.model.layers[0].mlp.up_proj.weight
            width = full.shape[0] // world
            out.model.layers[0].mlp.up_proj.weight.data = full[width:2 * width].clone().to(
                out.model.layers[0].mlp.up_proj.weight.device)
        return out
    return shard


def test_a_correct_shard_passes_the_check_and_leaves_every_cache_empty():
    with Engine(model(), max_batch=2, max_context=64, tensor_parallel_size=2,
                check_integrity=True) as engine:
        assert engine.kv.manager.kv_cache_usage() == 0.0
        engine.kv.manager.check_integrity()
        out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6))
    assert tokens(out) == hf_greedy("tiny-llama", [[1, 2, 3]], 6)


def test_a_wrong_column_split_on_one_rank_refuses_construction_naming_the_difference(monkeypatch):
    monkeypatch.setattr(worker, "shard_model", wrong_column_split(worker.shard_model))
    with pytest.raises(TensorParallelMismatchError,
                       match=r"sharded forward differs from the unsharded LlamaForCausalLM on "
                             r"rank 0 by [0-9.e+-]+ in a logit \(allowed [0-9.e+-]+\)"):
        Engine(model(), max_batch=2, max_context=64, tensor_parallel_size=2)
    assert not multiprocessing.active_children()
