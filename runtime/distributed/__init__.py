"""Tensor parallelism: one engine across several processes on torch.distributed (gloo on CPU;
on CUDA one GPU per rank, activations over NCCL, plans over gloo).

Rank 0 runs the scheduler and the memory managers once and sends each step's plan to every rank;
every rank's cache holds its share of the KV heads and executes the same memory ops; the model is
sharded by heads and MLP columns (``sharding``). ``Engine(model, tensor_parallel_size=N)`` starts
and stops the ranks; ``follow(model)`` runs ranks 1..N-1 under torchrun.
"""
from vmemkv.runtime.engine.errors import (TensorParallelConfigError, TensorParallelError,
                                          TensorParallelMismatchError)
from .sharding import check_tensor_parallel, kv_heads_per_rank, shard_model
from .worker import follow

__all__ = ["TensorParallelConfigError", "TensorParallelError", "TensorParallelMismatchError",
           "check_tensor_parallel",
           "follow", "kv_heads_per_rank", "shard_model"]
