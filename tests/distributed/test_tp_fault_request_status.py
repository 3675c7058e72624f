"""A tensor-parallel rank that dies ends every live request "failed" with the
TensorParallelError (its type and message in ``RequestOutput.error``), not "aborted" as a
user's abort or close: the engine closed itself, nobody asked. Ended requests stay as they
were; no rank process is left."""
from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from vmemkv.runtime.distributed import TensorParallelError
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineClosedError

from ..engine.conftest import model
from .test_tensor_parallel import _gone


@pytest.mark.parametrize("failing_call", ["step", "abort", "resize_cache"])
def test_a_killed_rank_fails_every_live_request_with_its_error(failing_call):
    resizable = {"max_cache_bytes": 1 << 22} if failing_call == "resize_cache" else {}
    engine = Engine(model(), max_batch=2, max_context=128, tensor_parallel_size=2,
                    self_check=False, tp_timeout_s=3.0, **resizable)
    pids = engine.tp.rank_pids                      # ranks 1..N-1
    short = engine.add_request([4, 5, 6], SamplingParams(max_new_tokens=1))
    live = [engine.add_request([1, 2, 3, i], SamplingParams(max_new_tokens=50)) for i in range(3)]
    engine.step()
    engine.step()
    before = {rid: [list(c.token_ids) for c in engine.output(rid).outputs] for rid in live}
    assert engine.status(short) == "finished" and sorted(engine.status(r) for r in live) == \
        ["running", "running", "waiting"]           # max_batch 2: one still waits
    os.kill(pids[0], signal.SIGKILL)
    aborted = []
    with pytest.raises(TensorParallelError, match="rank") as raised:
        if failing_call == "abort":   # its ending plan goes to every rank: it fails, unless
            engine.abort(live[0])     # the broadcast was sent before rank 0 saw the death
            aborted.append(live[0])   # (then the abort is the user's, and the step fails)
        if failing_call == "resize_cache":   # the grow's plan goes to every rank too
            engine.resize_cache(engine.cache_bytes + (1 << 16))
        for _ in range(50):
            engine.step()
    message = str(raised.value)
    for rid in aborted:
        assert (engine.output(rid).status, engine.output(rid).error) == ("aborted", None)
    for rid in set(live) - set(aborted):
        output = engine.output(rid)
        assert engine.status(rid) == output.status == "failed"
        assert (output.error.type, output.error.message, output.error.field) == \
            ("TensorParallelError", message, None)
        assert [c.finish_reason for c in output.outputs] == ["error"]
        assert [list(c.token_ids) for c in output.outputs] == before[rid]   # kept, none added
    finished = engine.output(short)
    assert (finished.status, finished.error) == ("finished", None)
    assert [c.finish_reason for c in finished.outputs] == ["length"]
    assert engine.closed and not engine.has_unfinished()
    with pytest.raises(EngineClosedError):
        engine.run_until_done()
    engine.close()                                  # idempotent: "failed" stays "failed"
    assert {engine.output(rid).status for rid in set(live) - set(aborted)} == {"failed"}
    assert all(_gone(p) for p in pids) and not multiprocessing.active_children()
