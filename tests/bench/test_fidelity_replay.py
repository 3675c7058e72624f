"""benchmarks/fidelity.py's engine replay on a fake engine and a fake clock: which arrival a
request's TTFT is measured from (no wall-clock time enters these tests)."""
from __future__ import annotations

import pytest

from vmemkv.benchmarks.fidelity import replay_engine
from vmemkv.runtime.engine.outputs import CompletionOutput, RequestOutput
from vmemkv.scheduler.workload import TraceEntry

STEP_S = 0.010


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0          # any origin: the replay measures from its own start

    def perf_counter(self) -> float:
        self.now_s += 1e-7           # reading the clock takes a little time (an idle loop spins)
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


class FakeEngine:
    """Every step takes STEP_S and samples one token for every unfinished request (the
    engine's clock: FakeClock's, from 0 at construction)."""

    def __init__(self, clock: FakeClock, failing=()) -> None:
        self.clock, self.t0 = clock, clock.now_s
        self.outputs, self.left, self.failing = {}, {}, set(failing)   # failing: request ids

    def add_request(self, prompt, sampling) -> int:
        rid = len(self.outputs)
        self.outputs[rid] = RequestOutput(rid, tuple(prompt), [CompletionOutput(0, [])],
                                          arrival_s=self.clock.now_s - self.t0)
        self.left[rid] = 0 if rid in self.failing else sampling.max_new_tokens
        self.outputs[rid].status = "failed" if rid in self.failing else "unfinished"
        return rid

    def has_unfinished(self) -> bool:
        return any(self.left.values())

    def step(self) -> None:
        self.clock.now_s += STEP_S
        for rid, left in self.left.items():
            if left:
                self.outputs[rid].outputs[0].token_times_s.append(self.clock.now_s - self.t0)
                self.left[rid] = left - 1
                if left == 1:
                    self.outputs[rid].status = "finished"

    def output(self, rid: int, pop: bool = False) -> RequestOutput:
        return self.outputs[rid]


def replay(entries, steps=None):
    clock = FakeClock()
    engine = FakeEngine(clock)
    return replay_engine(engine, entries, vocab=100, steps=steps,
                         perf_counter=clock.perf_counter, sleep=clock.sleep)


def test_a_request_arriving_mid_step_counts_the_rest_of_that_step_in_its_ttft():
    # request 1 arrives 4 ms into request 0's first step (0 -> 10 ms); the loop submits it
    # at 10 ms, the next step samples its first token at 20 ms: TTFT 16 ms, not 10 ms
    entries = [TraceEntry(4, 2, 0.0), TraceEntry(4, 2, 0.004)]
    timings, lags = replay(entries)
    assert [t.arrival_s for t in timings] == pytest.approx([0.0, 0.004], abs=1e-5)
    assert [t.ttft_s for t in timings] == pytest.approx([0.010, 0.016], abs=1e-5)
    assert lags == pytest.approx([0.0, 0.006], abs=1e-5)


def test_an_idle_engine_submits_at_the_arrival_and_measures_no_lag():
    entries = [TraceEntry(4, 1, 0.0), TraceEntry(4, 1, 0.030)]
    timings, lags = replay(entries)
    assert [t.ttft_s for t in timings] == pytest.approx([STEP_S, STEP_S], abs=1e-5)
    assert lags == pytest.approx([0.0, 0.0], abs=1e-5)


def test_an_idle_loop_sleeps_only_up_to_a_millisecond_before_the_next_arrival():
    clock = FakeClock()
    slept = []
    engine = FakeEngine(clock)
    replay_engine(engine, [TraceEntry(4, 1, 0.0), TraceEntry(4, 1, 0.030)], vocab=100,
                  perf_counter=clock.perf_counter,
                  sleep=lambda s: (slept.append(s), clock.sleep(s)))
    # idle from 10 ms (request 0 done) to the arrival at 30 ms: sleep to 29 ms, spin the rest
    assert sum(slept) == pytest.approx(0.030 - STEP_S - 0.001, abs=1e-5)


def test_a_request_the_engine_failed_is_refused_not_paired_with_the_next_ones_lag():
    # request 0 fails before its first token: its timing is missing, and the others' timings
    # were paired with the lags (and arrivals) of the requests before them, unsaid
    clock = FakeClock()
    engine = FakeEngine(clock, failing={0})
    entries = [TraceEntry(4, 2, 0.0), TraceEntry(4, 2, 0.004), TraceEntry(4, 2, 0.050)]
    with pytest.raises(RuntimeError, match=r"1 of 3 requests did not finish \(request 0: failed"):
        replay_engine(engine, entries, vocab=100, perf_counter=clock.perf_counter,
                      sleep=clock.sleep)
