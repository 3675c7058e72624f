"""A hypothesis state machine over one engine: requests are added, steps run, requests are
aborted (live, ended or unknown ids) and driver faults are injected (one call, or every call
from one on) at random. Checked throughout: no request is ever dropped (each is waiting,
running, swapped or ended finished / aborted / failed), unknown and ended ids are typed errors,
and memory matches the manager. Once everything has ended: manager stats, mapped pages, blocks
and swap bytes are back at the empty baseline, finished requests hold exactly transformers'
greedy tokens and aborted / failed ones a prefix of them."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from vmemkv import vmem
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import RequestEndedError, UnknownRequestError
from vmemkv.runtime.errors import PlanExecutionError
from vmemkv.vmem.faults import FaultInjectingDriver

from .conftest import greedy_problems, model

KiB = 1024
LIVE = {"waiting", "running", "swapped"}
ENDED = {"finished", "aborted", "failed"}
BASES = [[7, 3, 9, 1] * 11, [200, 100] * 22]    # shared prefixes: prefix hits are common
# tight caches (tiny-llama: 512 bytes per token): three sequences of up to 52 tokens do not fit,
# so preemption (recompute or swap) is common. vmem interleaved: 16-token pages, 6 groups; paged: 10 blocks of 8.
CACHES = {
    "vmem": dict(cache="vmem", layout="interleaved", page_bytes=4 * KiB, max_context=64,
                 cache_bytes=6 * 8 * KiB),
    "paged": dict(cache="paged", block_size=8, max_context=64, cache_bytes=10 * 8 * 512),
}


class EngineLifecycle(RuleBasedStateMachine):
    kind = "vmem"

    @initialize(swap=st.booleans(), sharing=st.booleans())
    def build(self, swap, sharing):
        kind = self.kind
        self.driver = FaultInjectingDriver(vmem.open_driver("host"))
        extra = dict(driver=self.driver) if kind == "vmem" else {}
        self.engine = Engine(model(), max_batch=3, max_tokens_per_step=24, max_plan_retries=1,
                             preemption="swap" if swap else "recompute",
                             swap_bytes=1 << 20 if swap else 0,
                             prefix_sharing=sharing, check_integrity=True,
                             **CACHES[kind], **extra)
        self.prompts, self.max_new = {}, {}

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        try:
            self.driver.disarm()
            engine.run_until_done()
            self.check_baseline_and_tokens()
        finally:
            engine.close()

    @rule(requests=st.lists(st.tuples(st.sampled_from(BASES), st.integers(3, 44),
                                      st.lists(st.integers(0, 255), max_size=8), st.integers(1, 12)),
                            min_size=1, max_size=3))
    def add(self, requests):
        for base, cut, tail, max_new in requests:
            prompt = base[:cut] + tail
            rid = self.engine.add_request(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
            self.prompts[rid], self.max_new[rid] = prompt, max_new

    @rule(steps=st.integers(1, 12),
          fault=st.none() | st.tuples(st.sampled_from(["map", "unmap", "copy"]), st.integers(0, 3)))
    def step(self, steps, fault):
        """Step, with one driver call failing first (persistently from then on, for copies:
        undoing a plan maps and unmaps, and an undo that fails leaves an unusable cache by
        contract, tested apart)."""
        if fault is not None:
            self.driver.fail_at(fault[0], fault[1], persistent=fault[0] == "copy")
        try:
            for _ in range(steps):
                if not self.engine.has_unfinished():
                    return
                try:
                    self.engine.step()
                except PlanExecutionError as error:
                    assert error.rolled_back
        finally:
            self.driver.disarm()

    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        if not self.prompts:
            return
        rid = sorted(self.prompts)[pick % len(self.prompts)]
        before = self.engine.status(rid)
        if before in ENDED:
            with pytest.raises(RequestEndedError, match=str(rid)):
                self.engine.abort(rid)
            return
        out = self.engine.abort(rid)
        assert out.status == "aborted" == self.engine.status(rid)

    @rule()
    def abort_unknown(self):
        with pytest.raises(UnknownRequestError, match="12345"):
            self.engine.abort(12345)

    @invariant()
    def no_request_is_dropped(self):
        if not hasattr(self, "engine"):
            return
        statuses = {rid: self.engine.status(rid) for rid in self.prompts}
        assert set(statuses.values()) <= LIVE | ENDED, statuses
        assert self.engine.has_unfinished() == any(s in LIVE for s in statuses.values())
        self.engine.cache.check_integrity()

    def check_baseline_and_tokens(self):
        engine = self.engine
        assert not engine.has_unfinished()
        mgr, cache = engine.cache.manager, engine.cache
        stats = mgr.stats()
        assert stats.live_tokens == 0 and cache.swapped_bytes == 0 and mgr.swap_free_bytes == mgr.swap_bytes
        if self.kind == "paged":
            assert stats.free_tokens == stats.total_tokens
        else:   # deferred pages stay mapped (reclaimable) by design; nothing else does
            assert stats.free_tokens + mgr.reclaimable_tokens == stats.total_tokens
            # a shared (prefix) group may stay mapped under several slots; a cached one may be
            # mapped nowhere (it keeps its content for a later hit)
            mapped = [g for slot in range(mgr.num_slots) for g in mgr.mapped_pages(slot).values()]
            unused = set(mapped) | set(mgr.cached_units())
            assert len(unused) * mgr.tokens_per_page == mgr.reclaimable_tokens
            assert cache.range.num_mapped_pages == len(mapped) * mgr.pages_per_group
        cache.check_integrity()
        for rid, prompt in self.prompts.items():
            out = engine.output(rid, pop=True)
            assert out.status in ENDED
            assert not greedy_problems("tiny-llama", prompt, out.outputs[0].token_ids,
                                       self.max_new[rid], whole=out.status == "finished"), (rid, out)


class PagedEngineLifecycle(EngineLifecycle):
    kind = "paged"


SETTINGS = settings(max_examples=10, stateful_step_count=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestVmemEngineLifecycle = EngineLifecycle.TestCase
TestVmemEngineLifecycle.settings = SETTINGS
TestPagedEngineLifecycle = PagedEngineLifecycle.TestCase
TestPagedEngineLifecycle.settings = SETTINGS
