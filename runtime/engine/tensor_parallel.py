"""The engine's side of tensor parallelism: refuse what cannot run, start the ranks.

The distributed package is imported on first use: a single-process engine never loads it."""
from __future__ import annotations

import torch

from .errors import TensorParallelConfigError

START_TIMEOUT_S = 300.0   # spawning a rank imports torch and transformers and builds a shard


def check_tensor_parallel_engine(model, cfg, device: torch.device) -> None:
    """TensorParallelConfigError, before any process starts or memory is built, for a size the
    model cannot be split into exactly or a setup this version does not run."""
    from vmemkv.runtime.distributed.sharding import check_tensor_parallel
    check_tensor_parallel(model, cfg.tensor_parallel_size)
    if cfg.tensor_parallel_size > 1 and device.type != "cpu":
        raise TensorParallelConfigError(
            f"tensor_parallel_size {cfg.tensor_parallel_size} on {device.type}: this version runs "
            f"tensor parallelism on the CPU (gloo) only; NCCL ranks on GPUs are not implemented")


def kv_heads_per_rank(config, world: int) -> int:
    """KV heads one rank's cache holds (runtime/distributed/sharding.py)."""
    from vmemkv.runtime.distributed.sharding import kv_heads_per_rank as per_rank
    return per_rank(config, world)


def check_ranks_fit(cfg, cache_bytes: int, device) -> None:
    """Spawned ranks share this machine's memory: CacheTooLargeError, before any process
    starts, when ``tensor_parallel_size`` caches of ``cache_bytes`` each do not fit what is
    available (ranks a launcher placed elsewhere check their own machine)."""
    if cfg.tensor_parallel_size > 1 and cfg.tp_launch == "spawn":
        from vmemkv.runtime.memory import check_fits_device
        check_fits_device(f"{cfg.tensor_parallel_size} tensor-parallel ranks' KV caches "
                          f"({cache_bytes} bytes each)", cfg.tensor_parallel_size * cache_bytes,
                          device)


def start_tensor_parallel(model, cfg, cache_config, kv_options: dict, attention: str,
                          driver=None):
    """Ranks 1..N-1 started (``tp_launch``), every rank's shard and cache built; rank 0's
    ``TensorParallel`` (its ``kv`` is the manager the scheduler plans on). ``driver``: rank 0's."""
    from vmemkv.runtime.distributed.launch import TensorParallel
    from vmemkv.runtime.distributed.worker import TPPayload
    payload = TPPayload(cache_config=cache_config, kind=cfg.cache, kv_options=dict(kv_options),
                        attention=attention, step_timeout_s=float(cfg.tp_timeout_s),
                        start_timeout_s=START_TIMEOUT_S, threads=torch.get_num_threads())
    return TensorParallel(model, payload, cfg.tensor_parallel_size, cfg.tp_launch, driver)
