"""A rank that dies or hangs is named in rank 0's TensorParallelError. Before, SIGKILL and
SIGSTOP of rank 1 both read "rank 0: plan broadcast failed or waited past 3.0 s (a rank died or
hung)": no rank named, and an immediate failure worded as a timeout. Now the message names the
rank whose process was killed (and the signal) or is stopped, and says "failed after" when the
collective failed before its timeout. ``tp_launch="env"`` without a launcher's variables is
refused naming them, before anything starts."""
from __future__ import annotations

import multiprocessing
import os
import re
import signal

import pytest
import torch.distributed as dist

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import TensorParallelConfigError, TensorParallelError
from vmemkv.runtime.models import build_model

from .test_tensor_parallel import STOPPED_RANK_TIMEOUT_S, stop_rank

# the collectives' limit while both ranks run: a killed rank is seen at once (its sockets
# close) and a stopped one only after stop_rank shortens it, so a long limit costs nothing
# and a busy machine cannot turn a death into a timeout
TIMEOUT_S = 30.0


def _fault_message(fault_signal: int) -> tuple:
    """(rank 1's pid, the TensorParallelError's message) once rank 1 got ``fault_signal``."""
    engine = Engine(build_model("tiny-llama", seed=0), max_batch=2, max_context=128,
                    tensor_parallel_size=2, self_check=False, tp_timeout_s=TIMEOUT_S)
    pid = engine.tp.rank_pids[0]
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True))
        engine.step()
        if fault_signal == signal.SIGSTOP:
            stop_rank(engine, pid)    # then rank 0 waits STOPPED_RANK_TIMEOUT_S
        else:
            os.kill(pid, fault_signal)
        with pytest.raises(TensorParallelError) as raised:
            for _ in range(50):
                engine.step()
    finally:
        if fault_signal == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.close()
    return pid, str(raised.value)


def test_a_killed_rank_is_named_with_its_signal_and_the_failure_is_not_called_a_timeout():
    pid, message = _fault_message(signal.SIGKILL)
    assert f"rank 1 (pid {pid}) was killed by SIGKILL" in message
    # the plan broadcast or an activation sum, whichever rank 0 was in as rank 1 died
    assert re.match(rf"rank 0: [a-z_ ]+ failed after [0-9.]+ s, before its {TIMEOUT_S:g} s "
                    rf"timeout", message)
    assert "waited past" not in message


def test_a_stopped_rank_is_named_as_stopped_once_the_collective_times_out():
    pid, message = _fault_message(signal.SIGSTOP)
    assert f"rank 1 (pid {pid}) is stopped" in message
    assert f"waited past {STOPPED_RANK_TIMEOUT_S:g} s" in message



ENV_LAUNCH = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("changed, named", [
    ({"MASTER_ADDR": None, "MASTER_PORT": None}, "MASTER_ADDR, MASTER_PORT are not set"),
    ({name: None for name in ENV_LAUNCH}, "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE are not set"),
    ({"RANK": "1"}, "RANK is 1: ranks 1..N-1 run vmemkv.runtime.distributed.follow"),
    ({"WORLD_SIZE": "3"}, "tensor_parallel_size 2 differs from the launcher's WORLD_SIZE 3"),
])
def test_an_env_launch_without_its_launchers_variables_is_refused_naming_them(monkeypatch, changed,
                                                                              named):
    """torch's own ValueError ("MASTER_ADDR expected") came out before; a RANK or WORLD_SIZE
    that disagrees would wait for ranks that never come."""
    for name, value in {**ENV_LAUNCH, **changed}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    before = multiprocessing.active_children()
    with pytest.raises(TensorParallelConfigError, match=re.escape(named)):
        Engine(build_model("tiny-llama", seed=0), max_batch=2, max_context=64,
               tensor_parallel_size=2, tp_launch="env", self_check=False)
    assert multiprocessing.active_children() == before and not dist.is_initialized()
