"""Two engines (two model families) drawing from one MemoryBudget, driven by a hypothesis
state machine over requests, steps, explicit grows and shrinks (with and without preemption),
sleep, wake and the idle clock. After every rule:

- the budget's bytes equal the sum of the engines' cache bytes, and never exceed its total;
- each engine's manager and cache agree (``check_matches``: no released page has memory);
- the drivers' truth: the kernel's allocated bytes of this process's vmemkv memfds equal the
  sum of the two pools' committed bytes, which never exceed their cache bytes.

At the end both wake and finish: every request finished (none dropped) with transformers'
greedy tokens for its model (up to a near-tie: the prompts are drawn at random).
"""
from __future__ import annotations

import gc

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmemkv.runtime.engine import Engine, RequestRejectedError, SamplingParams
from vmemkv.runtime.engine.errors import EngineSleepingError
from vmemkv.runtime.kv import check_matches
from vmemkv.scheduler.budget import MemoryBudget
from vmemkv.scheduler.errors import CacheResizeError

from .conftest import greedy_problems, model, tokens
from .test_elastic_engine import memfd_bytes
from ..hypothesis_budget import examples

KiB = 1024
GROUP = 16 * KiB            # a page group of the tiny models on 4 KiB per-layer pages
FAMILIES = ("tiny-llama", "tiny-qwen2")


class ElasticEngines(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = [0.0]
        gc.collect()   # engines other tests dropped unclosed free their memfds now, not mid-run
        self.base_fd = memfd_bytes()
        self.budget = MemoryBudget(24 * GROUP, idle_release_s=1.0, clock=lambda: self.clock[0])
        opts = dict(max_batch=4, max_context=64, layout="per-layer", page_bytes=4 * KiB,
                    check_integrity=True, preemption="swap", swap_bytes=1 << 20,
                    min_cache_bytes=4 * GROUP)
        self.engines = [Engine(model(f), memory_budget=self.budget, cache_bytes=8 * GROUP, **opts)
                        for f in FAMILIES]
        self.requests = [[], []]        # per engine: (request id, prompt, max_new_tokens)

    def teardown(self) -> None:
        try:
            for e, (engine, reqs) in enumerate(zip(self.engines, self.requests)):
                engine.wake()
                engine.run_until_done()
                out = [engine.output(rid, pop=True) for rid, _, _ in reqs]
                assert all(o.status == "finished" for o in out)
                for (rid, prompt, n), o in zip(reqs, out):
                    assert not greedy_problems(FAMILIES[e], prompt, tokens([o])[0], n)
        finally:
            for engine in self.engines:
                engine.close()
        assert self.budget.held_bytes == 0

    @rule(e=st.integers(0, 1), length=st.integers(1, 30), new=st.integers(1, 20),
          seed=st.integers(0, 255))
    def add(self, e, length, new, seed):
        prompt = [(seed * 31 + i * 7) % 256 for i in range(length)]
        engine = self.engines[e]
        try:
            rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        except RequestRejectedError:     # the cache was resized below what it needs
            assert length + new > engine.scheduler.max_fit_tokens
            return
        self.requests[e].append((rid, prompt, new))

    @rule(e=st.integers(0, 1), count=st.integers(1, 4))
    def step(self, e, count):
        for _ in range(count):
            self.engines[e].step()

    @rule(e=st.integers(0, 1), groups=st.integers(0, 24), preempt=st.booleans())
    def resize(self, e, groups, preempt):
        engine = self.engines[e]
        before = (engine.cache_bytes, self.budget.held_bytes)
        try:
            assert engine.resize_cache(groups * GROUP, preempt=preempt) == groups * GROUP
        except (CacheResizeError, EngineSleepingError):
            assert (engine.cache_bytes, self.budget.held_bytes) == before

    @rule(e=st.integers(0, 1))
    def sleep(self, e):
        self.engines[e].sleep()
        assert self.engines[e].cache_bytes == 0
        assert self.engines[e].kv.cache.pool.committed_bytes == 0

    @rule(e=st.integers(0, 1))
    def wake(self, e):
        self.engines[e].wake()
        assert not self.engines[e].is_sleeping

    @rule(seconds=st.sampled_from([0.5, 2.0]))
    def tick(self, seconds):
        self.clock[0] += seconds

    @invariant()
    def every_byte_accounted_once(self):
        engines = self.engines
        assert self.budget.held_bytes == sum(e.cache_bytes for e in engines) <= \
            self.budget.total_bytes
        committed = 0
        for engine in engines:
            check_matches(engine.kv.manager, engine.kv.cache)
            pool = engine.kv.cache.pool
            assert pool.committed_bytes <= engine.cache_bytes
            committed += pool.committed_bytes
        assert memfd_bytes() - self.base_fd == committed


TestTwoEnginesOneBudget = ElasticEngines.TestCase
TestTwoEnginesOneBudget.settings = settings(
    max_examples=examples(16), stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
