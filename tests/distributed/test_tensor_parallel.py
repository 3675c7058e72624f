"""Tensor parallelism on the CPU (gloo): exact tokens, half the KV bytes per rank, the shard check
at construction, refusals, and a rank that dies or hangs. Each TP engine spawns a process (a few
seconds), so these are few, and the tests that only run requests share one (``tp_engine``)."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime.distributed import TensorParallelConfigError, TensorParallelError, shard_model
from vmemkv.runtime.engine.errors import EngineClosedError
from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams
from vmemkv.runtime.errors import CacheStateError

from vmemkv import vmem
from vmemkv.vmem.faults import FaultInjectingDriver

from ..engine.conftest import hf_greedy, model, tokens

SHARED = [5, 9, 17, 33, 65, 129, 3, 4] * 3           # a shared 24-token prefix


def workload():
    return [SHARED + [i + 1, 2 * i + 7] for i in range(4)] + [[11, 12, 13], SHARED[:10] + [99]]


def run(family, n, **options):
    """Greedy tokens (2 samples per prompt), the per-rank cache bytes and the stats."""
    with Engine(model(family), max_batch=4, max_context=1024, prefix_sharing=True,
                tensor_parallel_size=n, **options) as engine:
        out = engine.generate(workload(), SamplingParams(max_new_tokens=12, n=2))
        return ([[c.token_ids for c in o.outputs] for o in out], engine.stats(),
                engine.kv.manager.stats().total_tokens * engine.cache_config.bytes_per_token)


@pytest.mark.parametrize("family, cache, preemption", [("tiny-llama", "vmem", "swap"),
                                                       ("tiny-qwen2", "paged", "recompute")])
def test_tp2_tokens_equal_tp1_and_transformers_with_preemption_forks_and_prefixes(
        family, cache, preemption):
    # tight caches (bytes per rank): the 12 sequences cannot all run, so some are preempted
    small = (dict(cache=cache, block_size=4, cache_bytes=24576) if cache == "paged"
             else dict(cache=cache, page_bytes=4096, cache_bytes=65536))
    small.update(preemption=preemption, swap_bytes=1 << 20 if preemption == "swap" else 0)
    one, stats1, bytes1 = run(family, 1, **small)
    two, stats2, bytes2 = run(family, 2, **dict(small, cache_bytes=small["cache_bytes"] // 2))
    expected = hf_greedy(family, workload(), 12)
    assert one == two == [[e, e] for e in expected]
    assert stats2.num_preemptions > 0 and stats1.num_preemptions > 0   # the cache was tight
    if preemption == "swap":
        assert stats2.num_swap_preemptions > 0
    assert bytes2 * 2 == bytes1                                        # each rank: half the KV


@pytest.mark.parametrize("size, match", [
    (0, "tensor_parallel_size must be an int >= 1, got 0"),
    (3, "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
    (8, "tensor_parallel_size 8 exceeds the model's 4 attention heads"),
])
def test_bad_sizes_are_refused_before_any_process_starts(size, match):
    before = multiprocessing.active_children()
    with pytest.raises((TensorParallelConfigError, EngineConfigError), match=match):
        Engine(model(), max_batch=2, max_context=64, tensor_parallel_size=size)
    assert multiprocessing.active_children() == before


def test_background_mapper_with_tp_is_refused():
    with pytest.raises(EngineConfigError, match="background_mapper is not supported"):
        Engine(model(), max_batch=2, max_context=64, tensor_parallel_size=2, background_mapper=True)


def test_shards_split_heads_and_replicate_kv_heads_past_their_count():
    m = model()   # 4 heads, 2 KV heads, head_dim 16, MLP width 128
    shards = [shard_model(m, r, 4, lambda t: None) for r in range(4)]
    attn = [s.model.layers[0].self_attn for s in shards]
    assert [a.q_proj.weight.shape[0] for a in attn] == [16] * 4
    assert [a.k_proj.weight.shape[0] for a in attn] == [16] * 4         # one KV head each
    original_k = m.model.layers[0].self_attn.k_proj.weight
    assert torch.equal(attn[0].k_proj.weight, original_k[:16]) and torch.equal(
        attn[1].k_proj.weight, original_k[:16]) and torch.equal(attn[2].k_proj.weight, original_k[16:])
    assert [s.model.layers[0].mlp.gate_proj.weight.shape[0] for s in shards] == [32] * 4
    assert m.model.layers[0].self_attn.q_proj.weight.shape[0] == 64     # the model is untouched


def test_ranks_started_by_torchrun_give_the_same_tokens(tmp_path):
    out = tmp_path / "tokens.json"
    script = os.path.join(os.path.dirname(__file__), "torchrun_ranks.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", script, str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(out.read_text()) == hf_greedy("tiny-llama", [[1, 2, 3, 4], [9, 8, 7]], 8)


def test_a_plan_failing_on_rank_0_is_rolled_back_before_any_rank_sees_it_and_output_stays_exact():
    driver = FaultInjectingDriver(vmem.open_driver("host"))
    batch = [[3, 1, 4, 1, 5, 9, 2, 6] * 3, [2, 7, 1, 8]]
    options = dict(cache="vmem", page_bytes=4096, max_batch=2, max_context=128, self_check=False)
    with Engine(model(), **options) as one:
        full_bytes = one.stats().cache_bytes
    with Engine(model(), driver=driver, tensor_parallel_size=2, check_integrity=True,
                **options) as engine:
        assert engine.stats().cache_bytes * 2 == full_bytes   # default-sized: half per rank
        assert engine.cache_config.num_kv_heads == 1
        driver.fail_at("map", 3)       # rank 0 fails a map before sending: rank 1 never sees it
        out = engine.generate(batch, SamplingParams(max_new_tokens=12))
        assert driver.faults_raised["map"] == 1 and engine.plan_failures == 1
    assert tokens(out) == hf_greedy("tiny-llama", batch, 12)


@pytest.fixture(scope="class")
def tp_engine():
    """One TP=2 engine (the shard check at construction, integrity checked every step) for the
    tests that only run requests through it: room for 16 prompts of 2,200 tokens in one step;
    ``usage_after_construction`` is read before any test used it. Class-scoped: rank 0 is this
    process, which belongs to one process group at a time, so it closes before other TP engines."""
    with Engine(model(), max_batch=16, max_context=2240, tensor_parallel_size=2,
                check_integrity=True, max_tokens_per_step=36000) as engine:
        engine.kv.manager.check_integrity()
        yield SimpleNamespace(engine=engine, usage_after_construction=engine.kv.manager.kv_cache_usage())


class TestOneSharedEngine:
    """The tests that only run requests: one spawned engine between them."""

    def test_a_correct_shard_passes_the_check_and_leaves_every_cache_empty(self, tp_engine):
        assert tp_engine.usage_after_construction == 0.0
        out = tp_engine.engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6))
        assert tokens(out) == hf_greedy("tiny-llama", [[1, 2, 3]], 6)

    def test_a_step_makes_one_plan_broadcast_and_two_sums_per_layer_and_nothing_else(self, tp_engine):
        engine, layers = tp_engine.engine, model().config.num_hidden_layers
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=6))
        before, steps = engine.tp.collectives, 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        assert engine.tp.collectives - before == steps * (1 + 2 * layers)

    def test_plans_larger_than_one_frame_cross_intact(self, tp_engine):
        # the first step prefills every prompt: its plan carries 35,200 token ids, more than the
        # 64 KiB the first broadcast frame holds, so the rest goes in a second broadcast
        import pickle
        from vmemkv.runtime.distributed.group import INLINE_BYTES
        big = [[(i * 7 + j) % 250 + 1 for j in range(2200)] for i in range(16)]
        assert len(pickle.dumps(big)) > INLINE_BYTES
        out = tp_engine.engine.generate(big, SamplingParams(max_new_tokens=2))
        assert tokens(out) == hf_greedy("tiny-llama", big, 2)


def test_memory_ops_failing_on_a_follower_are_fatal_while_rank_0_rolls_back_alone():
    from vmemkv.runtime.distributed.worker import RankExecutor
    from vmemkv.runtime.errors import PlanExecutionError

    class FailingCache:
        def execute(self, ops):
            raise PlanExecutionError("map failed", op_index=0, rolled_back=True)

    plan = SimpleNamespace(ops=["map"])
    runner = SimpleNamespace(cache=FailingCache())
    with pytest.raises(TensorParallelError, match="rank 1: its memory ops failed where rank 0's"):
        RankExecutor(SimpleNamespace(rank=1), runner).apply_ops(plan)
    with pytest.raises(PlanExecutionError, match="map failed"):   # nothing was sent yet
        RankExecutor(SimpleNamespace(rank=0), runner).apply_ops(plan)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie entry (reaped by its parent later)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" in f.read()
    except FileNotFoundError:
        return True


STOPPED_RANK_TIMEOUT_S = 0.2   # a step's wait on a rank already seen stopped: it never answers


def stop_rank(engine: Engine, pid: int) -> None:
    """SIGSTOP rank ``pid`` and wait until the kernel shows it stopped (/proc state T); then
    rank 0's collectives wait ``STOPPED_RANK_TIMEOUT_S``: they wait on a rank known to be
    stopped, which answers after no timeout at all, so a shorter one changes no outcome (the
    engine's own ``tp_timeout_s`` bounded the steps before, while the rank ran)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                engine.tp.group.step_timeout_s = STOPPED_RANK_TIMEOUT_S
                return
        time.sleep(0.005)
    raise AssertionError(f"rank pid {pid} not stopped 60 s after SIGSTOP")


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_rank_that_dies_or_hangs_raises_and_leaves_no_process_or_memory(fault):
    engine = Engine(model(), max_batch=2, max_context=128, tensor_parallel_size=2, self_check=False,
                    tp_timeout_s=3.0)
    pids = engine.tp.rank_pids
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=50))
    engine.step()
    if fault == "kill":
        os.kill(pids[0], signal.SIGKILL)
    else:
        stop_rank(engine, pids[0])
    with pytest.raises(TensorParallelError, match="rank 0: .* (failed after|waited past)"):
        for _ in range(50):
            engine.step()
    assert all(_gone(p) for p in pids) and not multiprocessing.active_children()
    with pytest.raises(CacheStateError, match="after close"):
        engine.kv.cache.execute([])      # rank 0's memory is released too
    # closed with its step rolled back: typed refusals (abort was a TransactionStateError, and
    # the server's engine thread died on it, leaving every stream without an end)
    assert engine.closed and not engine.has_unfinished()
    for call in (lambda: engine.abort(rid), engine.step):
        with pytest.raises(EngineClosedError):
            call()
    engine.close()   # idempotent after the fault


def test_ranks_whose_caches_together_exceed_free_memory_are_refused_before_starting(monkeypatch):
    from vmemkv.runtime import memory
    from vmemkv.runtime.errors import CacheTooLargeError
    # 3 MiB free: one rank's 2 MiB cache fits, two ranks' do not
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 3 * 2**20)
    before = multiprocessing.active_children()
    with pytest.raises(CacheTooLargeError, match="2 tensor-parallel ranks' KV caches"):
        Engine(model(), max_batch=2, max_context=128, tensor_parallel_size=2, self_check=False,
               cache_bytes=2 * 2**20, max_tokens_per_step=2)
    assert multiprocessing.active_children() == before
