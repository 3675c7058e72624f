"""Rank 0's side of tensor parallelism: start the other ranks, execute plans with them, close.

    tp = TensorParallel(model, payload, world, launch="spawn")   # ranks 1..N-1 as child processes
    logits, rows = tp.execute(plan)                               # the same plan on every rank
    tp.close()                                                    # stop ranks, free every cache

``driver`` is rank 0's vmem driver (the other ranks' caches open their own on their device).
``payload.placement`` says where each rank runs (placement.py): every rank makes its device
current before joining the group, and on CUDA the activation sums go over NCCL.
``launch="env"``: the ranks were started by torchrun (or any ``env://`` launcher) and ranks
1..N-1 run ``vmemkv.runtime.distributed.follow(model)``.
"""
from __future__ import annotations

import gc
import os
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist

from vmemkv.runtime.engine.errors import (LogitsShapeError, TensorParallelConfigError,
                                            TensorParallelError)
from vmemkv.runtime.errors import NonFiniteKVError
from .group import (RankGroup, SpawnedRanks, init_group, joined_by_engine, leave_group,
                    open_activation_group)
from .worker import (MemoryQuery, TPPayload, UnfixScales, UnfixUnsettled, adapter_upload,
                     agree_started, build_rank, enter_device, memory_state, spawned_rank_main,
                     unfix_scales)

LAUNCHES = ("spawn", "env")
ENV_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")   # torchrun sets them
FATE_SETTLE_S = 0.5   # a collective failed: how long to look for a rank that exited


def check_env_launch(world: int) -> None:
    """TensorParallelConfigError, before anything starts, when this process was not started as
    rank 0 of ``world`` by an ``env://`` launcher: a variable missing (naming each), RANK not 0,
    or WORLD_SIZE not ``world``."""
    missing = [name for name in ENV_LAUNCH_VARIABLES if not os.environ.get(name)]
    if missing:
        raise TensorParallelConfigError(
            f"tp_launch='env' joins ranks an env:// launcher started, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: run this script under torchrun "
            f"(torchrun --nproc-per-node {world} script.py), or use tp_launch='spawn'")
    if os.environ["RANK"] != "0":
        raise TensorParallelConfigError(
            f"tp_launch='env' builds the Engine on rank 0, but RANK is {os.environ['RANK']}: "
            f"ranks 1..N-1 run vmemkv.runtime.distributed.follow(model)")
    if os.environ["WORLD_SIZE"] != str(world):
        raise TensorParallelConfigError(
            f"tensor_parallel_size {world} differs from the launcher's WORLD_SIZE "
            f"{os.environ['WORLD_SIZE']}")


def check_no_group_open(launch: str) -> None:
    """TensorParallelConfigError, before anything starts or changes, when this process is in a
    torch.distributed group already: another tensor-parallel engine's (its ranks hold this
    process's default group: one such engine at a time), or one a launcher or the caller opened.
    Before, a second ``tp_launch="env"`` engine raised torch's ValueError and, closing, destroyed
    the open engine's group; a second ``"spawn"`` engine blamed torchrun."""
    if joined_by_engine():
        gc.collect()   # an engine dropped unclosed (engines hold reference cycles) is freed
                       # only by the collector, and then leaves the group (_abandoned)
    if not dist.is_initialized():
        return
    if joined_by_engine():
        raise TensorParallelConfigError(
            "another tensor-parallel engine of this process is open and holds its "
            "torch.distributed group: close() it first (one tensor-parallel engine per process "
            "at a time)")
    if launch == "spawn":
        raise TensorParallelConfigError(
            "this process already belongs to a torch.distributed group (torchrun?): use "
            "tp_launch='env' and run vmemkv.runtime.distributed.follow(model) on ranks 1..N-1")
    raise TensorParallelConfigError(
        "this process already belongs to a torch.distributed group: tp_launch='env' opens its "
        "own from the launcher's variables; call torch.distributed.destroy_process_group() first")


def _abandoned(spawned) -> None:
    """An engine collected without close() (weakref.finalize): its spawned ranks killed, each
    freeing its cache, and the group left, so a later engine can start. Before, the ranks
    held their caches until the process exited and every later engine was refused."""
    if spawned is not None:
        spawned.stop(grace_s=0.0)
    leave_group()


def _defining_module(model) -> tuple:
    """The module that defines ``model``'s class (or its loader), which each rank imports to
    unpickle it: the rank server imports it once (group.rank_context)."""
    name = (type(model).__module__ if isinstance(model, torch.nn.Module)
            else getattr(model, "__module__", None))
    return (name,) if isinstance(name, str) and name not in ("__main__", "__mp_main__") else ()


class TensorParallel:
    """Ranks 1..N-1 and rank 0's own shard; ``kv`` is rank 0's manager and cache (the scheduler
    plans on it), ``execute`` runs a plan on every rank."""

    def __init__(self, model, payload: TPPayload, world: int, launch: str = "spawn",
                 driver=None) -> None:
        if launch not in LAUNCHES:
            raise TensorParallelConfigError(f"tp_launch must be one of {', '.join(LAUNCHES)}, "
                                            f"got {launch!r}")
        if launch == "env":
            check_env_launch(world)
        check_no_group_open(launch)
        self.world, self.spawned, self.kv, self._open, self._failed = world, None, None, False, False
        # a forward ran on every rank since the engine last kept or dropped the 8-bit
        # first-write scales (settle_scales): a follower's may have fixed what rank 0's did not
        self._forward_unsettled = False
        self._finalizer = None   # kills the ranks of an engine dropped unclosed (_abandoned)
        self.host_adapter = lambda digest: None   # the engine's: digest -> LoraAdapter
        self.device = None     # rank 0's device, made current once the ranks have joined
        # the caller's current CUDA device, made current again at close (rank 0's enter_device
        # switches this process to its own); None on the CPU
        self._caller_cuda_device = (torch.cuda.current_device()
                                    if payload.placement.device_of(0).type == "cuda"
                                    and torch.cuda.is_available() else None)
        self.group = RankGroup(0, world, payload.step_timeout_s)
        try:
            self._join(model, payload, launch)
            self._build(model, payload, driver)
        except BaseException:
            self._failed = True     # nothing to wind down: close kills the ranks at once
            self.close()
            raise
        self._finalizer = weakref.finalize(self, _abandoned, self.spawned)
        self._finalizer.atexit = False   # at exit each rank ends with rank 0 (watch_parent)

    def _join(self, model, payload: TPPayload, launch: str) -> None:
        if launch == "spawn":
            self.spawned = SpawnedRanks(self.world, spawned_rank_main, replace(payload, model=model),
                                        payload.start_timeout_s, preload=_defining_module(model))
            self.spawned.wait_for("joined", payload.start_timeout_s)
            self.device = enter_device(payload.placement, 0)
            self._rendezvous(payload, store=dist.PrefixStore("pg", self.spawned.store))
        else:
            self._rendezvous(payload)   # check_env_launch found its variables
            self.group.broadcast(replace(payload, model=None))
            self.device = enter_device(payload.placement, 0)
        self._open = True
        open_activation_group(self.group, payload.placement.activation_backend, self.device)

    def _rendezvous(self, payload: TPPayload, store=None) -> None:
        """Join the group (``init_group``). TensorParallelError naming each spawned rank that
        exited or is stopped when it fails (torch's error: gloo refused or timed out after
        ``start_timeout_s``, the rendezvous store timed out); it was a bare RuntimeError, or
        a hang of 7 days (the group's idle timeout) for a rank stopped there."""
        try:
            init_group(0, self.world, start_timeout_s=payload.start_timeout_s, store=store)
        except Exception as error:   # noqa: BLE001 -- torch's: RuntimeError, DistStoreError
            raise self._with_rank_errors(TensorParallelError(
                f"rank 0: the group's rendezvous failed: {type(error).__name__}: "
                f"{str(error)[:200]}"), FATE_SETTLE_S) from error

    def _build(self, model, payload: TPPayload, driver) -> None:
        try:
            self.kv, self.executor = build_rank(payload, self.group, model, self.device, driver)
        except BaseException:
            agree_started(self.group, False, payload.start_timeout_s)
            raise
        try:
            started = agree_started(self.group, True, payload.start_timeout_s)
        except TensorParallelError as error:   # a rank died or stopped: named, as in a step
            raise self._with_rank_errors(error, FATE_SETTLE_S) from error.__cause__
        if not started:
            raise self._start_failure()

    def _start_failure(self) -> BaseException:
        """Why a rank failed to build (it reported before the agreement): its own
        CacheTooLargeError when its device lacked memory, else TensorParallelError naming each
        failed rank's error (with ``launch="env"``: see that rank's output)."""
        if self.spawned is None:
            return TensorParallelError("a rank failed to build its shard: see that rank's output")
        for r in range(1, self.world):
            typed = self.spawned.typed_error_of(r)
            if typed is not None:
                return typed
        failed = [f"rank {r}: {self.spawned.error_of(r)}" for r in range(1, self.world)
                  if self.spawned.error_of(r)]
        return TensorParallelError("a rank failed to build its shard: "
                                   + ("; ".join(failed) or "see that rank's output"))

    @property
    def rank_pids(self) -> list:
        """Process ids of the ranks this engine spawned (empty with ``launch="env"``)."""
        return [p.pid for p in self.spawned.procs] if self.spawned is not None else []

    @property
    def comm_s(self) -> float:
        """Seconds rank 0 spent in collectives (plan broadcasts, activation sums; the start agreement)."""
        return self.group.comm_s

    @property
    def collectives(self) -> int:
        """Collectives rank 0 has made (a step: one plan broadcast, two per layer in the model,
        one more on an 8-bit cache (the non-finite K/V agreement), one more broadcast for a
        plan over 64 KiB, one or two more when it loads LoRA adapters;
        a request ending early: one broadcast)."""
        return self.group.collectives

    def execute(self, plan):
        """Apply ``plan``'s memory ops here, send the plan (after the host copies of the LoRA
        adapters it loads, ``host_adapter``), run it on every rank; returns
        ``ModelRunner.execute``'s result. PlanExecutionError: rank 0's ops failed and were rolled
        back before anything was sent (the engine retries as on one process).
        NonFiniteKVError: a rank's forward made NaN/inf K/V for an 8-bit cache; every rank
        raised it together and is in step (the engine blames it as on one process), as with
        LogitsShapeError (checked after the forward's collectives, on the same logits on every
        rank). TensorParallelError: a rank died, hung or failed, or rank 0's forward raised anything
        else, leaving the others inside the step's collectives (the caller must close)."""
        upload = adapter_upload(plan, self.host_adapter)
        self.executor.apply_ops(plan)
        try:
            if upload is not None:
                self.group.broadcast(upload)
            self.group.broadcast(plan)
            self._forward_unsettled = self._forward_unsettled or bool(plan.seqs)
            return self.executor.forward(plan)
        except (NonFiniteKVError, LogitsShapeError):   # every rank raised it, in step
            raise
        except TensorParallelError as error:
            raise self._failed_with(error) from error.__cause__
        except Exception as error:
            self._failed = True    # the other ranks are in a collective this rank left
            raise self._with_rank_errors(TensorParallelError(
                f"rank 0: the forward raised {type(error).__name__}: {str(error)[:300]}; the "
                f"other ranks can no longer be in step with it")) from error

    def _failed_with(self, error: TensorParallelError) -> TensorParallelError:
        """``error`` naming the ranks that failed (``_with_rank_errors``), the group marked
        failed: close() then kills the ranks at once, as one may be hung."""
        self._failed = True
        return self._with_rank_errors(error, FATE_SETTLE_S)

    def _with_rank_errors(self, error: TensorParallelError,
                          settle_s: float = 0.0) -> TensorParallelError:
        """``error`` with what each spawned rank that failed reported before it exited (a rank
        that raised says why) and how each one that exited ended, or that it is stopped
        (``SpawnedRanks.fate_of``: its exit code or the signal that killed it). ``settle_s``:
        how long to look for such a rank when none is seen yet (a killed rank's sockets close,
        failing rank 0's collective, a moment before its exit can be read)."""
        if self.spawned is None:
            return error
        deadline = time.monotonic() + settle_s
        reasons = self._rank_reasons()
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.02)
            reasons = self._rank_reasons()
        return TensorParallelError(f"{error}; {'; '.join(reasons)}") if reasons else error

    def _rank_reasons(self) -> list:
        reasons = []
        for r in range(1, self.world):
            reported, fate = self.spawned.error_of(r), self.spawned.fate_of(r)
            reasons += ([f"rank {r}: {reported}"] if reported else []) + ([fate] if fate else [])
        return reasons

    def unfix_scales(self) -> None:
        """Every rank's first-write 8-bit scales unfixed (worker.UnfixScales; one broadcast).
        TensorParallelError as ``execute``."""
        unfix_scales(self.executor.runner.cache)
        try:
            self.group.broadcast(UnfixScales())
        except TensorParallelError as error:
            raise self._failed_with(error) from error.__cause__

    def settle_scales(self, keep: bool) -> None:
        """The engine kept (``keep``: a step committed) or dropped the 8-bit first-write scales
        fixed since it last did: rank 0's table settled (a follower's settles at its next
        forward), or unfixed on every rank (worker.UnfixUnsettled; one broadcast, when a forward
        ran since, whatever rank 0's journal holds: an open head, all 0 at its layer's first
        write, is fixed by the first write that reaches it on its own rank only, so a follower
        may have fixed one where rank 0 fixed nothing; none when no forward ran since, as a
        follower's journal then holds the kept step's). TensorParallelError as ``execute``."""
        scales = self.executor.runner.cache.kv_scales
        ran, self._forward_unsettled = self._forward_unsettled, False
        if scales is None:
            return
        if keep:
            scales.settle()
            return
        scales.unfix_unsettled()
        if self._failed or scales.given or not ran:
            return   # (failed: the ranks are closing, none would answer)
        try:
            self.group.broadcast(UnfixUnsettled())
        except TensorParallelError as error:
            raise self._failed_with(error) from error.__cause__

    def memory_states(self) -> list:
        """Every rank's ``worker.memory_state``, in rank order (two collectives; between steps).
        TensorParallelError as ``execute``."""
        try:
            self.group.broadcast(MemoryQuery())
            return self.group.gather(memory_state(self.executor.runner.cache), "memory state gather")
        except TensorParallelError as error:
            raise self._failed_with(error) from error.__cause__

    def close(self) -> None:
        """Stop every rank (a final broadcast when they are reachable; kill otherwise), leave the
        group, free rank 0's cache. Idempotent; never raises for a dead rank."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._open and not self._failed:
            self._open = False
            try:
                self.group.broadcast(None)
            except TensorParallelError:
                pass
        if self.spawned is not None:
            self.spawned.stop(grace_s=0.0 if self._failed else 5.0)
            self.spawned = None
        leave_group()
        if self.kv is not None:
            self.kv.close()
        if self._caller_cuda_device is not None:   # rank 0 made its device current (enter_device)
            torch.cuda.set_device(self._caller_cuda_device)
