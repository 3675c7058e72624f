"""The construction-time check of a tensor-parallel engine: every rank's sharded forward against
the unsharded model on rank 0. A wrong column split makes construction refuse, naming the
difference, with no process left (a correct shard passing it and leaving the caches empty:
test_tensor_parallel.py, on the engine its tests share)."""
from __future__ import annotations

import multiprocessing

import pytest

from vmemkv.runtime.distributed import TensorParallelMismatchError, worker
from vmemkv.runtime.engine import Engine

from ..engine.conftest import model


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


def test_a_wrong_column_split_on_one_rank_refuses_construction_naming_the_difference(monkeypatch):
    monkeypatch.setattr(worker, "shard_model", wrong_column_split(worker.shard_model))
    with pytest.raises(TensorParallelMismatchError,
                       match=r"sharded forward differs from the unsharded LlamaForCausalLM on "
                             r"rank 0 by [0-9.e+-]+ in a logit \(allowed [0-9.e+-]+\)"):
        Engine(model(), max_batch=2, max_context=64, tensor_parallel_size=2)
    assert not multiprocessing.active_children()
