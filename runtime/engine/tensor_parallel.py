"""The engine's side of tensor parallelism: refuse what cannot run, start the ranks, check them.

The distributed package is imported on first use: a single-process engine never loads it."""
from __future__ import annotations

import torch

from .errors import TensorParallelConfigError, TensorParallelMismatchError  # noqa: F401

START_TIMEOUT_S = 300.0   # spawning a rank imports torch and transformers and builds a shard


def placement_of(cfg, device: torch.device):
    """Where each rank runs (runtime/distributed/placement.py), from this process's view of the
    visible GPUs; TensorParallelConfigError when the size, device list or devices cannot run."""
    from vmemkv.runtime.distributed.placement import place_ranks
    visible = torch.cuda.device_count() if torch.device(device).type == "cuda" else 0
    return place_ranks(device, cfg.tensor_parallel_size, cfg.tp_devices, visible_cuda=visible,
                       launch=cfg.tp_launch)


def check_tensor_parallel_engine(model, cfg, device: torch.device) -> None:
    """TensorParallelConfigError, before any process starts or memory is built, for a size the
    model cannot be split into exactly, or devices / a backend the ranks cannot run on."""
    import torch.distributed as dist
    from vmemkv.runtime.distributed.placement import check_backends
    from vmemkv.runtime.distributed.sharding import check_tensor_parallel
    check_tensor_parallel(model, cfg.tensor_parallel_size)
    if cfg.tensor_parallel_size > 1 or cfg.tp_devices is not None:
        check_backends(placement_of(cfg, device), nccl_available=dist.is_nccl_available())


def kv_heads_per_rank(config, world: int) -> int:
    """KV heads one rank's cache holds (runtime/distributed/sharding.py)."""
    from vmemkv.runtime.distributed.sharding import kv_heads_per_rank as per_rank
    return per_rank(config, world)


def rank_kv_scales(scales, config, rank: int, world: int):
    """Rank ``rank``'s columns of 8-bit ``scales`` (runtime/distributed/sharding.py)."""
    from vmemkv.runtime.distributed.sharding import rank_kv_scales as columns
    return columns(scales, config, rank, world)


def check_ranks_fit(cfg, cache_bytes: int, device) -> None:
    """CacheTooLargeError, before any process starts, on the CPU: spawned ranks share this
    machine's memory, so ``tensor_parallel_size`` caches of ``cache_bytes`` each must fit what
    is available; their swap spaces (``swap_bytes`` each, host memory on any device) too. On
    CUDA no GPU is read here (rank 0's own device was checked with its budget): each rank
    checks its cache against ITS device's free memory in its own process
    (worker.check_rank_memory), as reading another GPU from rank 0 opens a CUDA context there.
    The message's remedy names the field the size came from (``memory_utilization`` is per
    rank: it named ``cache_bytes``, which the caller had not given)."""
    if cfg.tensor_parallel_size == 1 or cfg.tp_launch != "spawn":
        return
    from vmemkv.runtime.memory import check_fits_device, check_swap_fits
    check_swap_fits(cfg.swap_bytes, torch.device(placement_of(cfg, device).device_type),
                    cache_bytes, copies=cfg.tensor_parallel_size)   # every rank's, in host memory
    if placement_of(cfg, device).device_type == "cuda":
        return
    world, fraction = cfg.tensor_parallel_size, cfg.memory_utilization
    remedy = ("lower cache_bytes (or use memory_utilization)" if fraction is None else
              f"memory_utilization={fraction} is per rank: give at most 1/{world}")
    check_fits_device(f"{world} tensor-parallel ranks' KV caches ({cache_bytes} bytes each)",
                      world * cache_bytes, device, remedy=remedy)


def start_tensor_parallel(model, cfg, cache_config, kv_options: dict, attention: str,
                          driver=None, full_config=None):
    """Ranks 1..N-1 started (``tp_launch``), every rank's shard and cache built; rank 0's
    ``TensorParallel`` (its ``kv`` is the manager the scheduler plans on). ``driver``: rank 0's.
    ``full_config``: the unsharded cache's config (every KV head; its 8-bit scales go to the
    ranks, each taking its heads')."""
    from vmemkv.runtime.distributed.launch import TensorParallel
    from vmemkv.runtime.distributed.worker import TPPayload
    payload = TPPayload(cache_config=cache_config, kind=cfg.cache, kv_options=dict(kv_options),
                        attention=attention, step_timeout_s=float(cfg.tp_timeout_s),
                        start_timeout_s=START_TIMEOUT_S,
                        placement=placement_of(cfg, cache_config.torch_device),
                        threads=torch.get_num_threads(),
                        kv_scales=full_config.kv_scales if full_config is not None else None)
    tp = TensorParallel(model, payload, cfg.tensor_parallel_size, cfg.tp_launch, driver)
    if cfg.self_check:
        reference = None
        if full_config is not None and full_config.kv_encoding.storage != full_config.dtype:
            from vmemkv.runtime.attention import get_backend   # K/V rounded: the same rounding
            reference = (full_config, cfg, get_backend(attention))   # on one process
        try:
            check_shards(model, tp, cache_config.dtype, reference, cfg.max_context)
            if full_config is not None and full_config.kv_encoding.scaled \
                    and full_config.kv_scales is None:
                tp.unfix_scales()   # first-write scales: the first request's, not the check's
        except BaseException:
            tp.close()
            raise
    return tp


def check_shards(model, tp, dtype, reference, max_context: int) -> None:
    """Refuse to serve (TensorParallelMismatchError, naming the largest difference) unless every
    rank's sharded forward reproduces the unsharded model's logits on rank 0 for a few tokens,
    within the single-process self-check's tolerance (self_check.py). Leaves the caches empty.
    ``reference``: see ``sharded_difference``."""
    from .self_check import sharded_difference
    err, allowed = sharded_difference(model, tp.kv, tp.execute, dtype, reference, max_context)
    if not err <= allowed:
        raise TensorParallelMismatchError(
            f"the {tp.world} tensor-parallel ranks' sharded forward differs from the unsharded "
            f"{type(model).__name__} on rank 0 by {err:.3g} in a logit (allowed {allowed:.3g}); "
            f"refusing to serve wrong tokens (self_check=False skips this check and is unsafe)")
