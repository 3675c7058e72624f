"""The processes behind ``tensor_parallel_size > 1`` (runtime/distributed/group.py): ranks fork
from one multiprocessing forkserver per process, take rank 0's environment as it is when the
engine starts (not the server's, from when it started), and never outlive rank 0, however it
ends. The server stays for the process's lifetime; it ends with rank 0's process."""
from __future__ import annotations

import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from vmemkv.runtime.distributed import worker
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import CacheTooLargeError

from ..engine.conftest import model
from .test_tensor_parallel import _gone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))


def _engine(**kw) -> Engine:
    return Engine(model(), max_batch=2, max_context=64, cache="paged", cache_bytes=65536,
                  tensor_parallel_size=2, self_check=False, **kw)


def test_ranks_fork_from_one_server_and_see_rank_0s_environment_of_the_moment(monkeypatch):
    monkeypatch.delenv(worker.FREE_BYTES_HOOK, raising=False)
    with _engine() as first:
        (rank_pid,) = first.tp.rank_pids
        server = _parent_of(rank_pid)
        assert server != os.getpid()              # forked by the server, not by rank 0
        tokens = first.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0]
    assert _gone(rank_pid) and not multiprocessing.active_children()
    # set after the server started: only rank 0's environment passed at start reaches rank 1
    monkeypatch.setenv(worker.FREE_BYTES_HOOK, "1:4096")
    with pytest.raises(CacheTooLargeError, match="tensor-parallel rank 1's KV cache on cpu"):
        _engine()
    monkeypatch.delenv(worker.FREE_BYTES_HOOK)
    with _engine() as again:
        assert _parent_of(again.tp.rank_pids[0]) == server          # the same server
        assert again.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].outputs[0] \
            .token_ids == tokens.outputs[0].token_ids
    assert not multiprocessing.active_children()


def test_a_rank_writes_where_rank_0s_streams_point_when_the_engine_starts(tmp_path):
    """A forked rank inherits the server's stdout and stderr, from when the server started;
    rank 0 sends its own as they are now."""
    with _engine():                       # the server runs from here on
        pass
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, name in ((1, "out"), (2, "err")):
            with open(tmp_path / name, "wb") as f:
                os.dup2(f.fileno(), fd)
        with _engine() as engine:
            (rank,) = engine.tp.rank_pids
            for fd, name in ((1, "out"), (2, "err")):
                assert os.readlink(f"/proc/{rank}/fd/{fd}") == str(tmp_path / name)
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def test_a_model_of_hundreds_of_tensors_reaches_its_ranks(monkeypatch):
    """A model's CPU tensors cross to a rank as shared-memory file descriptors; a forkserver
    start message carries at most 256 (the real model's 272 tensors failed "too many fds").
    The payload goes after the start: 30 layers of Llama, 9 tensors each (273 tensors, about the
    real model's), on two ranks equal one process."""
    from transformers import AutoModelForCausalLM

    from vmemkv.runtime.models import model_config
    monkeypatch.delenv(worker.FREE_BYTES_HOOK, raising=False)
    config = model_config("tiny-llama")
    config.num_hidden_layers = 30
    torch.manual_seed(0)
    deep = AutoModelForCausalLM.from_config(config).eval()
    assert sum(1 for _ in deep.parameters()) > 256
    params, out = SamplingParams(max_new_tokens=4), {}
    for tp in (1, 2):
        with Engine(deep, max_batch=2, max_context=64, cache="paged", tensor_parallel_size=tp,
                    self_check=False) as engine:
            out[tp] = engine.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    assert out[2] == out[1]


def test_an_unknown_start_method_is_refused_by_name_and_starts_nothing(monkeypatch):
    from vmemkv.runtime.distributed.group import START_METHOD_ENV
    from vmemkv.runtime.engine.errors import TensorParallelConfigError
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(TensorParallelConfigError, match="VMEMKV_TP_START_METHOD='fork': ranks "
                                                        "start with one of forkserver, spawn"):
        _engine()
    assert not multiprocessing.active_children()


STUCK_START_TIMEOUT_S = 0.2   # how long rank 0 waits for the rank that can never join

SCRIPT = """
import os, sys, time
if __name__ == "__mp_main__" and os.environ.get("VMEMKV_TP_START_METHOD") == "spawn":
    time.sleep(600)   # a spawned rank importing this script never reaches its payload
if __name__ == "__main__":
    from transformers import AutoModelForCausalLM
    from vmemkv.runtime.engine import Engine, tensor_parallel
    from vmemkv.runtime.models import build_model, model_config
    # spawn: the rank imports this script before anything else and sleeps at once (the guard
    # above names spawn, so the forked rank below runs); the payload's send is the same for both.
    # That rank never joins, however long rank 0 waits: a short start timeout changes no outcome
    os.environ["VMEMKV_TP_START_METHOD"] = "spawn"
    tensor_parallel.START_TIMEOUT_S = float(sys.argv[1])   # the test's STUCK_START_TIMEOUT_S
    config = model_config("tiny-llama")
    config.num_hidden_layers = 80            # a payload larger than a pipe's buffer
    model = AutoModelForCausalLM.from_config(config).eval()
    try:
        Engine(model, max_batch=2, max_context=64, cache="paged", tensor_parallel_size=2,
               self_check=False)
        print("the engine started", flush=True)
    except Exception as error:
        print(type(error).__name__, error, flush=True)
    # then ranks forked from the rank server, as by default
    del os.environ["VMEMKV_TP_START_METHOD"]
    tensor_parallel.START_TIMEOUT_S = 300.0
    engine = Engine(build_model("tiny-llama"), max_batch=2, max_context=64, cache="paged",
                    cache_bytes=65536, tensor_parallel_size=2, self_check=False)
    (rank,) = engine.tp.rank_pids
    server = next(int(l.split()[1]) for l in open(f"/proc/{rank}/status") if l.startswith("PPid:"))
    print(rank, server, flush=True)
    time.sleep(120)
"""


def _line(proc: subprocess.Popen, what: str) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, f"the script printed nothing in 120 s, waiting for {what}"
    return proc.stdout.readline()


def test_a_stuck_rank_times_out_and_killing_rank_0_ends_its_ranks_and_the_server(tmp_path):
    """One script (one interpreter's start for both) in a process of its own, rank 0:
    first a spawned rank stuck before its payload (importing the main module) times out
    instead of blocking rank 0 (it sent the payload on a thread of its own; before, rank 0
    blocked in the send, past every timeout). Then an engine with ranks forked from the rank
    server; rank 0 is killed: its rank and the server end."""
    script = tmp_path / "rank0.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(STUCK_START_TIMEOUT_S)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={k: v for k, v in os.environ.items()
                                 if k != "VMEMKV_TP_START_METHOD"})
    try:
        stuck = _line(proc, "the stuck rank's error")
        assert (f"TensorParallelError rank(s) [1] did not reach 'joined' within "
                f"{STUCK_START_TIMEOUT_S:g} s") in stuck, stuck
        rank, server = map(int, _line(proc, "the rank and server ids").split())
        assert server != proc.pid                # forked by the rank server, not by rank 0
        proc.send_signal(signal.SIGKILL)       # no finally, no atexit: only the kernel's cleanup
        proc.wait(10)
        deadline = time.monotonic() + 10
        while not (_gone(rank) and _gone(server)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(rank) and _gone(server)
    finally:
        proc.kill()
        proc.wait()
