"""One rank's executor, and the loop a follower rank (1..N-1) runs.

Every rank holds its shard of the model and a cache with its share of the KV heads, built from
the same ``TPPayload``, so the same plan means the same memory ops on every rank. A step:

    rank 0: cache.execute(plan.ops)             before anything is sent: a failure is rolled
                                                back there and the plan never leaves rank 0
    plan = broadcast(plan)                      one collective (two for a plan over 64 KiB);
                                                receiving it means rank 0's ops succeeded
    ranks 1..N-1: cache.execute(plan.ops)       a failure here is fatal (TensorParallelError):
                                                that rank's cache could no longer match rank 0's
    model(plan's tokens)                        two activation all_reduces per layer
    8-bit cache: ranks_flagging(non-finite K/V) one all_reduce: any rank's NaN/inf K/V is
                                                NonFiniteKVError on every rank, together
    rank 0 samples (followers' logits are unused), so ranks never disagree on tokens

So a step makes 1 + 2 * layers collectives (one more on an 8-bit cache) and no other
agreement: every rank builds the same caches from the same payload, with every physical page
created up front, so ops that succeed on rank 0 fail elsewhere only on a driver fault, which
ends the engine. A rank whose forward raises anything else has left the step's collectives
(the others wait in them): that ends the engine too (TensorParallelError on rank 0).

8-bit first-write scales: each rank's ScaleTable journals the layers its writes fixed. A
follower settles them (keeps them) when the next plan's forward starts; when rank 0 drops a
step or a lone re-run (the engine's ``_settle_scales(keep=False)``) it sends UnfixUnsettled
first, and a refused forward unfixes them on every rank at its agreement.
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from vmemkv.runtime.errors import CacheTooLargeError, NonFiniteKVError, PlanExecutionError

# build_rank's imports (LoRA's among them) at module level: the rank server imports this module
# (group.rank_context), so a rank forked from it finds them loaded
from vmemkv.runtime.attention import get_backend
from vmemkv.runtime.engine.errors import LogitsShapeError, TensorParallelError
from vmemkv.runtime.engine.model_runner import ModelRunner
from vmemkv.runtime.kv import make_kv
from vmemkv.runtime.lora.executor import AdapterExecutor
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.plan import EvictAdapter, LoadAdapter
from .group import (RankGroup, init_group, leave_group, lift_group_timeout,
                    open_activation_group, rank_0_takes_interrupts, take_std_streams, watch_parent)
from .placement import RankPlacement
from .sharding import rank_kv_scales, shard_model

# Test hook: "R:BYTES" (comma-separated for several ranks) makes rank R read BYTES as its
# device's available memory in check_rank_memory, so CPU tests can starve one rank. Unset in use.
FREE_BYTES_HOOK = "VMEMKV_TEST_RANK_FREE_BYTES"


@dataclass
class TPPayload:
    """What every rank needs to build its cache and runner (picklable)."""
    cache_config: Any                 # runtime.config.CacheConfig, this rank's share of KV heads
    kind: str                         # "vmem" or "paged"
    kv_options: dict                  # make_kv keywords (cache_bytes, layout, page_bytes, ...)
    attention: str                    # backend name
    step_timeout_s: float
    start_timeout_s: float
    placement: RankPlacement          # every rank's device and the activation backend
    threads: int = 0                  # torch threads per rank (0: leave torch's default)
    model: Any = None                 # a module (shared memory / CUDA IPC) or a picklable
                                      # loader; None in env mode
    kv_scales: Any = None             # 8-bit KV: every KV head's KVScales; each rank's cache
                                      # takes its heads' columns (sharding.rank_kv_scales)


def load_model(model_or_loader):
    """The module itself, or what a loader (a picklable callable) returns."""
    if isinstance(model_or_loader, torch.nn.Module):
        return model_or_loader
    return model_or_loader()


class UnfixScales:
    """Broadcast instead of a plan: every rank unfixes its cache's first-write 8-bit scales
    (``ScaleTable.unfix``), which the sharded self-check's prompt fixed. Nothing is answered."""


def unfix_scales(cache) -> None:
    if cache.kv_scales is not None:
        cache.kv_scales.unfix()


class UnfixUnsettled:
    """Broadcast instead of a plan: every rank unfixes the first-write 8-bit scales fixed since
    they were last settled (``ScaleTable.unfix_unsettled``: rank 0 dropped the step or lone run
    whose forward fixed them). Nothing is answered."""


class AdapterUpload:
    """Broadcast before a plan that loads LoRA adapters: their host copies (LoraAdapter) by
    digest. A follower keeps each until a plan evicts it from the pool (rank 0's engine keeps
    its own registry, runtime/engine/adapters.py)."""

    def __init__(self, adapters: dict) -> None:
        self.adapters = adapters


def adapter_upload(plan, host_copy) -> Optional[AdapterUpload]:
    """The AdapterUpload rank 0 sends before ``plan`` (None when it loads no adapter);
    ``host_copy``: digest -> LoraAdapter (the engine's registry)."""
    loads = {op.adapter_id: host_copy(op.adapter_id) for op in plan.ops
             if isinstance(op, LoadAdapter)}
    if not loads:
        return None
    missing = [digest[:12] for digest, adapter in loads.items() if adapter is None]
    if missing:   # a bug: the scheduler pinned an adapter the engine does not hold
        raise TensorParallelError(f"adapters {', '.join(missing)} loaded with no weights")
    return AdapterUpload(loads)


class RankExecutor:
    """Executes plans on this rank's cache and model shard, in step with the other ranks.
    A follower's ``runner.adapters`` reads the host copies rank 0 uploaded (``host_adapters``);
    rank 0's is the engine's registry, set by the engine."""

    def __init__(self, group: RankGroup, runner) -> None:
        self.group, self.runner = group, runner
        self.host_adapters: dict = {}    # followers: digest -> LoraAdapter, while in the pool

    def apply_ops(self, plan) -> None:
        """This rank's memory ops of ``plan``, then the weights of the adapters it loads. On
        rank 0 (run before the plan is sent) a failure raises the cache's PlanExecutionError,
        nothing having left rank 0. On any other rank a failure raises TensorParallelError:
        rank 0 applied the plan, so the caches would differ."""
        try:
            self.runner.cache.execute(plan.ops)
        except PlanExecutionError as error:
            if self.group.rank == 0:
                raise
            raise TensorParallelError(
                f"rank {self.group.rank}: its memory ops failed where rank 0's succeeded "
                f"({error}); its cache can no longer match rank 0's") from error
        if self.runner.adapters is not None:
            self.runner.adapters.apply(plan.ops, self.runner.cache)
        last = {op.adapter_id: op for op in plan.ops if isinstance(op, (LoadAdapter, EvictAdapter))}
        for digest, op in last.items():   # a plan may evict an idle adapter and load it again
            if isinstance(op, EvictAdapter):
                self.host_adapters.pop(digest, None)

    def forward(self, plan):
        """The model on ``plan``'s tokens (its ops already applied on every rank); returns
        ``ModelRunner.execute``'s result. A PlanExecutionError here becomes TensorParallelError:
        the other ranks have applied the plan, so it cannot be rolled back on one. On an 8-bit
        cache the ranks then agree on whether any stored non-finite K/V (one all_reduce): if
        one did, every rank unfixes the scales this forward fixed and raises the same
        NonFiniteKVError, all still in step."""
        scales = self.runner.cache.kv_scales
        if scales is not None and self.group.rank != 0:
            scales.settle()   # rank 0 kept the last forward's (else it sent UnfixUnsettled)
        try:
            result = self.runner.execute(replace(plan, ops=[]))
        except PlanExecutionError as error:
            raise TensorParallelError(f"rank {self.group.rank}: {error}") from error
        if scales is not None and plan.seqs:
            self._agree_finite(scales)
        return result

    def _agree_finite(self, scales) -> None:
        """NonFiniteKVError on every rank (scales fixed since the last settle unfixed) when any
        rank's forward wrote non-finite K/V (``ScaleTable.non_finite``); one collective."""
        mine, scales.non_finite = scales.non_finite, None
        flagged = self.group.ranks_flagging(mine is not None, "non-finite K/V agreement")
        if not flagged:
            return
        scales.unfix_unsettled()
        where = ", ".join(str(r) for r in flagged)
        raise NonFiniteKVError(f"tensor-parallel rank(s) {where}: "
                               + (mine or "K or V holds NaN or +-inf, which an 8-bit cache "
                                          "cannot store"))


def enter_device(placement: RankPlacement, rank: int, local_rank=None) -> torch.device:
    """This rank's device, made the current CUDA device first (before any group or cache)."""
    device = placement.device_of(rank, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def build_rank(payload: TPPayload, group: RankGroup, model, device: torch.device, driver=None):
    """This rank's (kv, executor): the executor runs its model shard on ``device`` (projections
    sliced, activations summed over ``group``) on a cache built exactly as every other rank
    builds its own, on ``device`` (``driver``: this rank's vmem driver; None: the cache opens
    its own, ``vmem.open_driver("cuda", device.index)`` on a GPU)."""
    shard = shard_model(model, group.rank, group.world, group.all_reduce_,
                        copy_first=group.rank == 0, device=device)
    check_rank_memory(group.rank, payload.kv_options.get("cache_bytes"), device)
    config = replace(payload.cache_config, device=str(device))
    if payload.kv_scales is not None:
        config = replace(config, kv_scales=rank_kv_scales(payload.kv_scales, shard.config,
                                                          group.rank, group.world))
    kv = make_kv(config, payload.kind, driver=driver, **payload.kv_options)
    if kv.cache.kv_scales is not None:   # non-finite K/V: refused after the forward, together
        kv.cache.kv_scales.defer_non_finite = True
    kv.cache.refuses_unstorable = False  # fp16 past its range: NaN logits, one rank not alone
    try:
        runner = ModelRunner(shard, kv.cache, get_backend(payload.attention))
        executor = RankExecutor(group, runner)
        if group.rank != 0:      # rank 0's is the engine's registry (Engine sets it)
            runner.adapters = AdapterExecutor(shard, executor.host_adapters.get)
        return kv, executor
    except BaseException:
        kv.close()
        raise


def check_rank_memory(rank: int, cache_bytes: Optional[int], device: torch.device) -> None:
    """CacheTooLargeError (naming the rank, its device, the bytes asked and the limit) when this
    rank's cache of ``cache_bytes`` exceeds ``device``'s total or available memory (GPU free,
    host MemAvailable). Run in the rank's own process on its own, already current device, after
    its shard is there and before its cache is built: so it sees what the cache will get, and
    no process reads another rank's GPU (rank 0 doing so opened a CUDA context, hundreds of MiB,
    on every GPU). ``FREE_BYTES_HOOK`` replaces the available memory read, for tests."""
    if cache_bytes is None:
        return
    from vmemkv.runtime.memory import check_fits_device
    check_fits_device(f"tensor-parallel rank {rank}'s KV cache on {device}", cache_bytes, device,
                      available_bytes=_hooked_free_bytes(rank))


def _hooked_free_bytes(rank: int) -> Optional[int]:
    """The available bytes ``FREE_BYTES_HOOK`` gives ``rank`` ("R:BYTES[,R:BYTES...]"), or None."""
    for entry in os.environ.get(FREE_BYTES_HOOK, "").split(","):
        name, _, value = entry.partition(":")
        if name.strip() == str(rank) and value.strip().isdigit():
            return int(value)
    return None


class MemoryQuery:
    """Broadcast instead of a plan: every rank answers with ``memory_state`` of its cache
    (``TensorParallel.memory_states``; tests and diagnostics). Nothing changes anywhere."""


def memory_state(cache, host_adapters=None) -> dict:
    """What one rank's cache holds, as plain data that is equal on ranks that applied the same
    plans (except ``swapped_bytes`` and ``kv_scales``: a rank's share of the KV heads; the
    latter its 8-bit scales, k, v, fixed and unsettled layers, or None): the replica's placements,
    the host copies' tokens and bytes, the resident LoRA adapters ({digest: (units, bytes)}),
    and on vmem every slot's mapped extents ({page_index: {kind: pool pages}}) and how many
    pool pages they map. A follower adds the digests of the adapters' host copies it keeps
    (``host_adapters``: those resident, no others)."""
    state = {"placements": {s: cache.placement(s) for s in cache.placed_seq_ids},
             "swapped_tokens": cache.swapped_tokens(), "swapped_bytes": cache.swapped_bytes,
             "resident_adapters": cache.resident_adapters(), "kv_scales": None}
    table = cache.kv_scales
    if table is not None:
        state["kv_scales"] = {"k": table.k.tolist(), "v": table.v.tolist(),
                              "fixed": list(table.fixed), "unsettled": list(table.unsettled)}
    if host_adapters is not None:
        state["adapter_host_copies"] = sorted(host_adapters)
    if cache.kind is CacheKind.VMEM:
        state["mapped_extents"] = {slot: cache.mapped_extents(slot)
                                   for slot in range(cache.config.max_batch)}
        state["mapped_pool_pages"] = cache.mapped_pool_pages
    return state


def serve_plans(group: RankGroup, executor: RankExecutor) -> None:
    """A follower's loop: execute every plan rank 0 broadcasts until it sends None (close);
    answer a MemoryQuery with this rank's ``memory_state``; keep an AdapterUpload's adapters
    for the plan that follows it; apply an UnfixScales or UnfixUnsettled. An agreed
    NonFiniteKVError or a LogitsShapeError leaves this rank in step: it waits for the next plan;
    anything else a plan raises ends this rank (rank 0 then closes)."""
    while True:
        plan = group.broadcast(idle=True)
        if plan is None:
            return
        if isinstance(plan, MemoryQuery):
            group.gather(memory_state(executor.runner.cache, executor.host_adapters),
                         "memory state gather")
            continue
        if isinstance(plan, AdapterUpload):
            executor.host_adapters.update(plan.adapters)
            continue
        if isinstance(plan, UnfixScales):
            unfix_scales(executor.runner.cache)
            continue
        if isinstance(plan, UnfixUnsettled):
            executor.runner.cache.kv_scales.unfix_unsettled()
            continue
        executor.apply_ops(plan)
        try:
            executor.forward(plan)
        except (NonFiniteKVError, LogitsShapeError):
            continue   # every rank raised it (the agreement; the same logits, after the
                       # forward's collectives): rank 0's engine handles it


def _follow(group: RankGroup, payload: TPPayload, model, device, on_error=None) -> None:
    try:
        if payload.threads:
            torch.set_num_threads(payload.threads)
        kv, executor = build_rank(payload, group, model, device)
    except BaseException as error:
        if on_error is not None:
            on_error(error)
        agree_started(group, False, payload.start_timeout_s)
        raise
    try:
        if not agree_started(group, True, payload.start_timeout_s):
            return      # another rank failed to build: rank 0 closes the group
        serve_plans(group, executor)
    finally:
        kv.close()


def agree_started(group: RankGroup, ok: bool, timeout_s: float) -> bool:
    """True when every rank built its shard and cache (``ok``): then ``lift_group_timeout``."""
    started = group.min_over_ranks(1 if ok else 0, "start agreement", timeout_s) == 1
    if started:
        lift_group_timeout()
    return started


def spawned_rank_main(rank: int, world: int, host: str, port: int, environ: dict,
                      payload_reader) -> None:
    """Entry point of a rank rank 0 spawned: take rank 0's environment (``environ``), and the
    TPPayload and standard streams it sends (``payload_reader``, group.SpawnedRanks); join,
    build, follow; errors go to the store. Ends with ``os._exit``: every resource was released
    in order above, and an interpreter's teardown with torch loaded costs a second a rank.
    SIGINT is ignored: rank 0 decides what a terminal's Ctrl-C means (rank_0_takes_interrupts)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environ)
    watch_parent()
    try:
        payload, streams = payload_reader.recv()
        take_std_streams(streams)
    except (EOFError, OSError):        # rank 0 failed before sending: it reports why
        _exit(1)
    finally:
        payload_reader.close()
    store = dist.TCPStore(host, port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=payload.start_timeout_s))

    def report(error: BaseException) -> None:
        if isinstance(error, CacheTooLargeError):    # the user's to fix: rank 0 raises it as is
            store.set(f"typed_error{rank}", pickle.dumps(CacheTooLargeError(str(error))))
        store.set(f"error{rank}", f"{type(error).__name__}: {error}"[:2000])

    try:
        device = enter_device(payload.placement, rank)
        store.set(f"joined{rank}", "1")
        init_group(rank, world, start_timeout_s=payload.start_timeout_s,
                   store=dist.PrefixStore("pg", store))
        group = RankGroup(rank, world, payload.step_timeout_s)
        open_activation_group(group, payload.placement.activation_backend, device)
        _follow(group, payload, load_model(payload.model), device, on_error=report)
    except BaseException as error:
        try:
            report(error)
        except Exception:
            pass
        _exit(1)
    finally:
        leave_group()
    _exit(0)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def follow(model_or_loader, *, step_timeout_s: float = 60.0, start_timeout_s: float = 300.0) -> None:
    """Run rank ``RANK`` (1..WORLD_SIZE-1) of an engine whose rank 0 runs
    ``Engine(..., tensor_parallel_size=WORLD_SIZE, tp_launch="env")``, for processes started by
    torchrun (or any launcher that sets the ``env://`` variables). Returns when rank 0's engine
    closes; raises TensorParallelError when a rank dies or hangs. On CUDA this rank runs on
    cuda:LOCAL_RANK (torchrun's convention). Once rank 0's payload arrived, SIGINT is ignored
    (on the main thread) until it returns: rank 0 decides what a Ctrl-C means."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        raise TensorParallelError("follow() runs ranks 1..N-1; rank 0 builds the Engine")
    init_group(rank, world, start_timeout_s=start_timeout_s)
    try:
        group = RankGroup(rank, world, step_timeout_s)
        payload: TPPayload = replace(group.broadcast(idle=True), step_timeout_s=step_timeout_s,
                                     start_timeout_s=start_timeout_s)
        device = enter_device(payload.placement, rank, int(os.environ.get("LOCAL_RANK", rank)))
        open_activation_group(group, payload.placement.activation_backend, device)
        with rank_0_takes_interrupts():
            _follow(group, payload, load_model(model_or_loader), device)
    finally:
        leave_group()
