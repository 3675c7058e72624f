"""What a tensor-parallel engine leaves in rank 0's process: once it ends (closed, or dropped
unclosed) nothing of its group, its ranks or torch's traceback hook; and an engine refused
because another one's group is open leaves that group as it was.

Before: torch's init_process_group wrapped ``sys.excepthook`` and nothing unwrapped it, so every
TP engine of a process added one "[rank0]: " to each later traceback line; a second
``tp_launch="env"`` engine raised torch's ValueError and, closing, destroyed the open engine's
group (a second ``"spawn"`` one blamed torchrun); an engine collected without ``close()`` left
its ranks alive, holding their caches, and its group joined, so every later TP engine of the
process was refused."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

from vmemkv.runtime.distributed.group import RankGroup, SpawnedRanks, init_group, leave_group
from vmemkv.runtime.distributed.worker import agree_started
from vmemkv.runtime.engine import Engine, SamplingParams, tensor_parallel
from vmemkv.runtime.engine.errors import TensorParallelConfigError, TensorParallelError
from vmemkv.runtime.models import build_model

ENV_LAUNCH = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531", "RANK": "0", "WORLD_SIZE": "2"}


def _own_hook(*args) -> None:
    """A user's traceback hook, set while a group is open."""


def test_leaving_the_group_puts_back_the_traceback_hook_torch_wrapped_and_keeps_a_users():
    before = sys.excepthook
    for _ in range(2):     # one engine after another: no "[rank0]: " piles up
        init_group(0, 1, start_timeout_s=5.0, store=dist.HashStore())
        assert sys.excepthook is not before        # torch's "[rank0]: " prefixer, while open
        leave_group()
        assert sys.excepthook is before and not dist.is_initialized()
    init_group(0, 1, start_timeout_s=5.0, store=dist.HashStore())
    try:
        sys.excepthook = _own_hook                 # the user's, set while the group is open
        leave_group()
        assert sys.excepthook is _own_hook         # not taken back
    finally:
        sys.excepthook = before
        leave_group()


def test_started_ranks_wait_for_the_next_plan_for_a_century_not_a_week():
    """A follower's idle wait (``broadcast(idle=True)``) is bounded by nothing but the gloo
    group's own timeout. It was 7 days: a server idle for a week lost rank 1 (it timed out and
    exited) and its next request closed the engine, though the docs promise a follower waits
    as long as rank 0 lives. (Read from the group: the wait itself cannot be run for years.)"""
    init_group(0, 1, start_timeout_s=5.0, store=dist.HashStore())
    try:
        gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert gloo.options._timeout.total_seconds() == 5.0        # the rendezvous's
        assert agree_started(RankGroup(0, 1, step_timeout_s=5.0), True, timeout_s=5.0)
        assert gloo.options._timeout.days >= 365 * 100
    finally:
        leave_group()


@pytest.mark.timeout(120)
def test_a_rank_stopped_in_the_rendezvous_fails_the_start_in_its_timeout_naming_it(monkeypatch):
    """Rank 1 stopped (SIGSTOP) after it joined the store, in or before the gloo rendezvous:
    rank 0 waited there for the group's idle timeout, 7 days, inside Engine(); a rank killed
    there gave torch's bare RuntimeError. Now the start timeout bounds it (gloo retries its
    connect: a few times the timeout) and the error names the rank, wherever it stopped."""
    monkeypatch.setattr(tensor_parallel, "START_TIMEOUT_S", 1.0)
    wait_for = SpawnedRanks.wait_for

    def stop_rank_1_once_joined(self, key, timeout_s):
        wait_for(self, key, 120.0)          # a first start (the rank server's) may take seconds
        if key == "joined":
            os.kill(self.procs[0].pid, signal.SIGSTOP)
    monkeypatch.setattr(SpawnedRanks, "wait_for", stop_rank_1_once_joined)
    before = multiprocessing.active_children()
    with pytest.raises(TensorParallelError,
                       match=r"rank 0: (the group's rendezvous|start agreement) .*; "
                             r"rank 1 \(pid \d+\) is stopped"):
        Engine(build_model("tiny-llama", seed=0), max_batch=2, max_context=64,
               tensor_parallel_size=2, self_check=False)
    assert multiprocessing.active_children() == before and not dist.is_initialized()


@pytest.mark.parametrize("launch", ["env", "spawn"])
def test_an_engine_refused_while_another_engines_group_is_open_names_it_and_leaves_it_open(
        launch, monkeypatch):
    for name, value in ENV_LAUNCH.items():
        monkeypatch.setenv(name, value)
    model, before = build_model("tiny-llama", seed=0), multiprocessing.active_children()
    init_group(0, 1, start_timeout_s=5.0, store=dist.HashStore())   # as an open engine's
    try:
        with pytest.raises(TensorParallelConfigError,
                           match="another tensor-parallel engine of this process is open"):
            Engine(model, max_batch=2, max_context=64, tensor_parallel_size=2, tp_launch=launch,
                   self_check=False)
        assert dist.is_initialized() and dist.get_world_size() == 1   # still the open one's
        assert multiprocessing.active_children() == before
    finally:
        leave_group()


def test_an_engine_dropped_without_close_ends_its_ranks_so_the_next_one_starts():
    model, hook = build_model("tiny-llama", seed=0), sys.excepthook
    prompts, params = [[1, 2, 3, 4], [5, 6]], SamplingParams(max_new_tokens=3)
    engine = Engine(model, max_batch=2, max_context=64, tensor_parallel_size=2, self_check=False)
    pids = engine.tp.rank_pids
    first = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    del engine        # unclosed, and held by its own reference cycles until a collection
    with Engine(model, max_batch=2, max_context=64, tensor_parallel_size=2,
                self_check=False) as engine:            # refused before, naming torchrun
        assert [p for p in pids if os.path.exists(f"/proc/{p}")] == []   # killed and reaped
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == first
    assert not dist.is_initialized() and sys.excepthook is hook
