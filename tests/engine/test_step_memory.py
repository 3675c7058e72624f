"""Memory a step uses beside the KV cache, checked before it is committed.

Prompt logprobs (a client's ``echo`` + ``logprobs``) are scored ``LOGPROB_SLICE_ROWS`` rows at a
time with int32 counts (they made [rows, vocab] fp32 log-softmax plus an int64 copy: 4.6 GB for a
2,048-token prompt on a 131,072 vocabulary) and give the same numbers as scoring all rows at
once; one step's logits are checked beside the cache when the engine is built. The swap space
promised at construction is left out of what ``resize_cache`` and ``rebalance_memory`` may grow
into, and a swap-out whose buffer the host cannot provide now is refused (nothing allocated, the
step rolled back) instead of over-committing. Available memory is faked (monkeypatch)."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime import memory
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine import logprobs
from vmemkv.runtime.errors import CacheTooLargeError, PlanExecutionError
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError

from ..vmem_only_options import options_for
from .conftest import model, prompts, tokens

KiB = 1024
VOCAB = 256   # tiny-llama's


def _entries(outs) -> list:
    return [o.prompt_logprobs for o in outs]


def test_prompt_rows_are_scored_in_slices_with_the_numbers_of_one_pass(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(50, 512) * 4
    ids = torch.randint(0, 512, (50,)).tolist()
    monkeypatch.setattr(logprobs, "LOGPROB_SLICE_ROWS", 10**9, raising=False)
    whole = logprobs.rows_logprobs(logits, ids, 5)          # every row at once (the old way)
    monkeypatch.setattr(logprobs, "LOGPROB_SLICE_ROWS", 7)
    assert logprobs.rows_logprobs(logits, ids, 5) == whole   # ranks, logprobs, top 5: equal
    collector = logprobs.PromptLogprobs([0] + ids, 5)
    collector.add(0, logits)
    assert collector.entries()[1:] == whole
    seen = []   # (op, rows, dtype) of every log_softmax and sum (rank counts) scoring makes
    log_softmax, tensor_sum = torch.log_softmax, torch.Tensor.sum
    monkeypatch.setattr(torch, "log_softmax", lambda x, *a, **k: (
        seen.append(("log_softmax", x.shape[0], x.dtype)), log_softmax(x, *a, **k))[1])
    monkeypatch.setattr(torch.Tensor, "sum", lambda x, *a, **k: (
        seen.append(("sum", x.shape[0], k.get("dtype"))), tensor_sum(x, *a, **k))[1])
    logprobs.PromptLogprobs([0] + ids, 0).add(0, logits)
    # 50 rows in slices of at most 7 (all 50 at once, counted in int64, made 50 x 512 x 8 bytes)
    assert [rows for _, rows, _ in seen[::2]] == [7] * 7 + [1]
    assert {(op, dtype) for op, _, dtype in seen} == {("log_softmax", torch.float32),
                                                     ("sum", torch.int32)}


def test_an_engines_prompt_logprobs_are_the_same_with_small_slices(monkeypatch):
    batch = prompts(2, 20, 40, seed=5)
    params = SamplingParams(max_new_tokens=4, prompt_logprobs=4, ignore_eos=True)
    opts = dict(max_batch=2, max_context=64, max_tokens_per_step=32, self_check=False)
    monkeypatch.setattr(logprobs, "LOGPROB_SLICE_ROWS", 10**9, raising=False)
    with Engine(model(), **opts) as engine:
        reference = engine.generate(batch, params)
    monkeypatch.setattr(logprobs, "LOGPROB_SLICE_ROWS", 3)
    rows, log_softmax = [], torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda x, *a, **k: (
        rows.append(x.shape[0]), log_softmax(x, *a, **k))[1])
    with Engine(model(), **opts) as engine:
        sliced = engine.generate(batch, params)
    assert max(rows) == 3 and sum(rows) > 3 * 10      # 20 to 40 prompt rows, 3 at a time
    assert tokens(sliced) == tokens(reference)             # greedy tokens unchanged
    assert _entries(sliced) == _entries(reference)
    assert all(len(e) == len(p) and e[0] is None for e, p in zip(_entries(sliced), batch))


def test_one_steps_logits_are_checked_beside_the_cache_before_anything_is_built(monkeypatch):
    from vmemkv.vmem.faults import FaultInjectingDriver
    from vmemkv.vmem.host import HostDriver
    # 512 rows (+ 4 sampled) of 256 fp32 logits, and one 64-row slice scored at 17 bytes a logit
    logits_bytes = (512 + 4) * VOCAB * 4 + 64 * VOCAB * 17
    cache_bytes = 64 * KiB
    monkeypatch.setattr(memory, "available_memory_bytes",
                        lambda device: cache_bytes + logits_bytes - 1)
    driver = FaultInjectingDriver(HostDriver())
    opts = dict(max_batch=4, max_context=64, page_bytes=4096, cache_bytes=cache_bytes,
                self_check=False)
    with pytest.raises(CacheTooLargeError) as info:
        Engine(model(), max_tokens_per_step=512, driver=driver, **opts)
    message = str(info.value)
    for words in (f"one step's logits ({logits_bytes} bytes", "max_tokens_per_step=512",
                  f"256-token vocabulary", f"needs {cache_bytes + logits_bytes} bytes",
                  f"MemAvailable is {cache_bytes + logits_bytes - 1} bytes"):
        assert words in message, (words, message)
    assert driver.calls["create_pages"] == 0 and driver.calls["reserve"] == 0
    with Engine(model(), max_tokens_per_step=256, **opts) as engine:   # fewer rows: it fits
        out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, prompt_logprobs=0))
        assert len(out[0].prompt_logprobs) == 3
    assert logprobs.step_logits_bytes(512, 4, VOCAB) == logits_bytes == 806_912


SWAP_OPTS = dict(max_batch=4, max_context=512, page_bytes=4096, layout="per-layer",
                 preemption="swap", swap_bytes=512 * KiB, max_tokens_per_step=8, self_check=False)


def test_resize_cache_does_not_grow_into_the_unfilled_swap_space(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 768 * KiB)
    with Engine(model(), cache_bytes=64 * KiB, max_cache_bytes=512 * KiB, **SWAP_OPTS) as engine:
        with pytest.raises(CacheResizeError) as info:    # 448 + 512 > 768 (448 <= 768 passed)
            engine.resize_cache(512 * KiB)
        assert engine.cache_bytes == 64 * KiB
        for words in ("growing the KV cache by 458752 bytes", "524288 bytes of swap space",
                      "needs 983040 bytes", "MemAvailable is 786432 bytes"):
            assert words in str(info.value), (words, str(info.value))
        assert engine.unfilled_swap_bytes == 512 * KiB
        assert engine.resize_cache(320 * KiB) == 320 * KiB   # 256 + 512 = 768: fits


def test_rebalance_does_not_grow_into_the_unfilled_swap_space(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 768 * KiB)
    budget = MemoryBudget(1 << 20)
    with Engine(model(), memory_budget=budget, cache_bytes=32 * KiB, **SWAP_OPTS) as engine:
        monkeypatch.setattr(engine.memory_share, "decide", lambda *a, **k: 640 * KiB)
        engine.rebalance_memory()
        # 32 KiB + (768 KiB available - 512 KiB of swap unfilled); it grew to 640 KiB before
        assert engine.cache_bytes == budget.held_bytes == 288 * KiB


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_a_swap_out_the_host_cannot_hold_now_is_refused_and_undone(monkeypatch, cache):
    available = [1 << 20]
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: available[0])
    opts = dict(cache=cache, max_batch=4, max_context=64, block_size=8,
                cache_bytes=64 * KiB, preemption="swap", swap_bytes=64 * KiB,
                max_tokens_per_step=4, self_check=False, **options_for(cache, page_bytes=4096))
    batch, params = [[1, 2, 3]] * 4, SamplingParams(max_new_tokens=40, ignore_eos=True)
    with Engine(model(), **opts) as engine:
        reference = engine.generate(batch, params)
        assert engine.stats().num_swap_preemptions > 0
    with Engine(model(), **opts) as engine:
        ids = [engine.add_request(p, params) for p in batch]
        available[0] = 4 * KiB          # another process took the host's memory
        with pytest.raises(PlanExecutionError) as info:
            for _ in range(200):
                engine.step()
        assert isinstance(info.value.__cause__, CacheTooLargeError)
        assert "swapping out sequence" in str(info.value)
        assert "MemAvailable is 4096 bytes" in str(info.value)
        assert engine.kv.cache.swapped_bytes == 0 and not engine.scheduler.swapped
        assert engine.stats().num_swap_preemptions == 0
        available[0] = 1 << 20          # memory back: the same step runs, swaps, and finishes
        engine.run_until_done()
        assert [engine.output(i).outputs[0].token_ids for i in ids] == tokens(reference)
        assert engine.stats().num_swap_preemptions > 0
