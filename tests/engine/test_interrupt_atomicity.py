"""A step is recorded whole or not at all: an exception anywhere in it (a KeyboardInterrupt at
any point, as Ctrl-C or a signal handler raises one) leaves either every token of the step in
the scheduler and in the outputs, or none of them, and the next step computes them again. So
an interrupted run, resumed with ``run_until_done()``, ends with exactly the tokens, text,
logprobs and finish reasons of an uninterrupted one: nothing dropped, nothing duplicated,
memory accounted exactly. The interrupt is injected deterministically at the k-th event (a
function call, or a line) of the engine's and the scheduler's own code, for every k."""
from __future__ import annotations

import os
import sys

import pytest

import vmemkv.runtime.cache.vmem_cache as vmem_cache_module
import vmemkv.runtime.engine.engine as engine_module
import vmemkv.vmem.vrange as vrange_module
import vmemkv.scheduler.scheduler as scheduler_module
from vmemkv.runtime.engine import Engine, SamplingParams

from .byte_tokenizer import byte_tokenizer
from .conftest import model, prompts

# the engine's and the scheduler's (managers included) source folders, but the page geometry:
# pure arithmetic (a third of a run's calls), where an exception is one at its caller's call
TRACED = tuple(os.path.dirname(m.__file__) + os.sep for m in (engine_module, scheduler_module))
PURE = os.path.join(os.path.dirname(scheduler_module.__file__), "geometry.py")
X = ord("x")
# one request that reaches every kind of recording: two forked, seeded, sampled samples with
# logprobs and prompt logprobs, both ending at token 2: one by a stop string ("xx"), one by length
LEAN = [SamplingParams(max_new_tokens=2, temperature=0.8, seed=4, n=2, logprobs=1, prompt_logprobs=1,
                       logit_bias={X: 5.0}, stop=["xx"], ignore_eos=True)]
RICH = [SamplingParams(max_new_tokens=2, temperature=0.8, seed=1, n=2, logprobs=1, ignore_eos=True),
        SamplingParams(max_new_tokens=5, logit_bias={X: 100.0}, stop=["xx"], prompt_logprobs=1,
                       ignore_eos=True),
        SamplingParams(max_new_tokens=4, ignore_eos=True),
        SamplingParams(max_new_tokens=3, top_p=0.9, seed=7, ignore_eos=True)]
ENGINE = dict(max_batch=4, max_context=64)


class Interrupter:
    """Raises KeyboardInterrupt at the k-th ``kind`` event ("call" or "line") of traced code
    (``traced``: source folders or files, the engine's and the scheduler's by default).
    ``as_signals``: at the first function entry after the k-th line, anywhere, which is where
    CPython raises a signal's KeyboardInterrupt (at calls and backward jumps, never at a
    ``try:`` or a ``return`` inside one, whose instructions lie outside every enclosing
    handler's range: raised there, as a tracer can, it escapes them all)."""

    def __init__(self, kind: str, traced: tuple = TRACED, as_signals: bool = False) -> None:
        self.kind, self.left, self.where, self.traced = kind, 0, None, traced
        self.as_signals, self.pending = as_signals, None

    def arm(self, k: int) -> None:
        self.left, self.where, self.pending = k, None, None
        sys.settrace(self._enter)

    def disarm(self) -> bool:
        """Stop tracing; whether the interrupt was raised."""
        sys.settrace(None)
        return self.where is not None

    def _enter(self, frame, event, arg):
        if self.pending is not None:          # a function entry after the chosen line
            self.where, self.pending = f"{self.pending}, raised entering {frame.f_code.co_name}", None
            raise KeyboardInterrupt
        name = frame.f_code.co_filename
        if not name.startswith(self.traced) or name == PURE:
            return None
        return self._event(frame, event, arg)

    def _event(self, frame, event, arg):
        if event == self.kind and self.left:
            self.left -= 1
            if not self.left:
                where = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
                if self.as_signals:
                    self.pending = where
                    return self._event
                self.where = where
                raise KeyboardInterrupt
        # a "call" count needs no line events: CPython sends every frame's call (a generator's
        # resumption too) to the global tracer (_enter), whatever the frame's local one is
        return None if self.kind == "call" and not self.pending else self._event


def results(outputs) -> list:
    """Everything a client gets back, per request and sample."""
    return [(o.status, o.prompt_logprobs,
             [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs,
               len(c.token_times_s))
              for c in o.outputs]) for o in outputs]


def sweep(engine, batch, params, kind: str, stride: int = 1, first: int = 1,
          traced: tuple = TRACED, fresh=lambda: None, as_signals: bool = False) -> int:
    """Interrupt a run of ``batch`` at event ``first``, ``first + stride``, ... until a run
    ends without reaching that event; after each, resume and compare with an uninterrupted
    run. Returns the number of interrupts."""
    before = engine.scheduler.metrics.generated_tokens
    want = results(engine.generate(batch, params))
    sampled = engine.scheduler.metrics.generated_tokens - before
    interrupter, k, interrupts = Interrupter(kind, traced, as_signals), first, 0
    while True:
        before = engine.scheduler.metrics.generated_tokens
        fresh()
        ids = [engine.add_request(p, s) for p, s in zip(batch, params)]
        interrupter.arm(k)
        try:
            engine.run_until_done()
        except KeyboardInterrupt:
            pass
        finally:
            fired = interrupter.disarm()
        engine.run_until_done()                      # the same engine resumes
        got = results([engine.output(rid, pop=True) for rid in ids])
        where = f"interrupt at {kind} event {k} ({interrupter.where})"
        assert got == want, where
        assert engine.scheduler.metrics.generated_tokens - before == sampled, where   # none twice
        manager = engine.kv.manager
        manager.check_integrity()
        engine.cache.check_integrity()
        assert manager.stats().live_tokens == 0 and not engine.has_unfinished(), where
        if not fired:
            return interrupts
        interrupts += 1
        k += stride


# an interrupt injected into a generator's own close (a sampler genexpr the step abandons) can
# only be reported as unraisable: that is the injection, not the engine
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_at_every_call_of_a_run_drops_and_duplicates_nothing():
    """Every function call the engine, the scheduler and the manager make in a run (schedule,
    execute, sample, commit, update, emit, detokenize, ...) is interrupted once."""
    with Engine(model(), byte_tokenizer(), cache="vmem", **ENGINE) as engine:
        reasons = [c.finish_reason for c in engine.generate(prompts(1, 5, 9, seed=3), LEAN)[0].outputs]
        assert reasons == ["length", "stop"]
        assert sweep(engine, prompts(1, 5, 9, seed=3), LEAN, "call") >= 500


@pytest.mark.parametrize("name, options, first", [
    ("tiny-llama", dict(cache="vmem"), 1),
    ("tiny-llama", dict(cache="vmem", layout="interleaved"), 2),
    ("tiny-llama", dict(cache="paged"), 3),
    ("tiny-llama", dict(cache="vmem", background_mapper=True), 4),
    ("tiny-mistral-swa", dict(cache="vmem"), 5),     # a sliding window: the hybrid manager
])
def test_an_interrupt_at_lines_of_every_cache_kind_drops_and_duplicates_nothing(name, options, first):
    """Lines (a stride of them, a different offset per kind) of a run of every cache kind,
    with the background mapper, and with a windowed model (prompts past its window)."""
    low, high = (36, 44) if name == "tiny-mistral-swa" else (5, 12)
    with Engine(model(name), byte_tokenizer(), **options, **ENGINE) as engine:
        assert sweep(engine, prompts(4, low, high, seed=4), RICH, "line", stride=331, first=first) >= 15


@pytest.mark.parametrize("options, first", [(dict(layout="per-layer"), 1),
                                            (dict(layout="interleaved"), 5),
                                            (dict(layout="per-layer", background_mapper=True), 9)],
                         ids=["per-layer", "interleaved", "mapper"])
def test_an_interrupt_at_lines_of_the_vmem_executor_drops_and_duplicates_nothing(options, first):
    """Lines of what executes a vmem plan: binding it to the replica, mapping and unmapping
    pages, the page pool's bookkeeping (a Ctrl-C there once left a page recorded as mapped
    twice, or counted -1 mappings, and every later step refused)."""
    traced = tuple(os.path.join(os.path.dirname(f), name) for f, name in (
        (vmem_cache_module.__file__, "vmem_ops.py"), (vmem_cache_module.__file__, "vmem_cache.py"),
        (vrange_module.__file__, "vrange.py"), (vrange_module.__file__, "pool.py")))
    with Engine(model(), cache="vmem", page_bytes=4096, **options, **ENGINE) as engine:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 9)]

        def unmapped() -> None:        # every run maps its pages: none kept from the last
            engine.sleep()
            engine.wake()

        assert sweep(engine, prompts(2, 5, 12, seed=6), params, "line", stride=29, first=first,
                     traced=traced, fresh=unmapped, as_signals=True) >= 70


def test_the_issue_repro_an_interrupt_entering_emit_loses_no_token(monkeypatch):
    """Issue 27 item 3: KeyboardInterrupt as ``Engine._emit`` is entered for the 5th time."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        want = engine.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
        emit, calls = Engine._emit, []

        def interrupted_emit(self, *args):
            calls.append(1)
            if len(calls) == 5:
                raise KeyboardInterrupt
            return emit(self, *args)

        monkeypatch.setattr(Engine, "_emit", interrupted_emit)
        rid = engine.add_request([1, 2, 3], params)
        with pytest.raises(KeyboardInterrupt):
            engine.run_until_done()
        engine.run_until_done()
        got = engine.output(rid, pop=True).outputs[0].token_ids
    assert len(got) == 20 and got == want


def test_a_raising_callback_loses_no_token_and_stops_no_other_callback():
    """A callback that raises does so after the step is recorded: its token is in the output,
    every other request's callback still gets the step's token, and the run resumes."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    batch = prompts(3, 5, 9, seed=5)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        want = [o.outputs[0].token_ids for o in engine.generate(batch, params)]
        seen = {}

        def on_token(event):
            seen.setdefault(event.request_id, []).append(event.token_id)
            if event.request_id == ids[0] and len(seen[event.request_id]) == 3:
                raise ValueError("a client's callback failed")

        ids = [engine.add_request(p, params, on_token=on_token) for p in batch]
        with pytest.raises(ValueError, match="callback failed"):
            engine.run_until_done()
        assert len({len(seen[rid]) for rid in ids}) == 1    # every callback got that step's token
        engine.run_until_done()
        got = [engine.output(rid, pop=True).outputs[0].token_ids for rid in ids]
    assert got == want and [seen[rid] for rid in ids] == want


def test_an_interrupt_at_each_of_a_runs_last_engine_lines_leaves_the_engine_steppable():
    """Every one of the last 40 lines a run executes in the engine's own step code, the end of
    its last step included: the step-inside-a-step guard once reset a flag there, and an
    interrupt at that line left it set, so every later step was EngineBusyError."""
    folder = os.path.dirname(engine_module.__file__)
    files = tuple(os.path.join(folder, name) for name in ("engine.py", "lifecycle.py"))
    batch = prompts(1, 5, 9, seed=3)
    with Engine(model(), byte_tokenizer(), cache="vmem", **ENGINE) as engine:
        counter = Interrupter("line", files)
        ids = [engine.add_request(p, s) for p, s in zip(batch, LEAN)]
        counter.arm(10**9)          # the lines of run_until_done, as sweep counts them
        engine.run_until_done()
        counter.disarm()
        for rid in ids:
            engine.output(rid, pop=True)
        lines = 10**9 - counter.left
        assert sweep(engine, batch, LEAN, "line", first=lines - 40, traced=files) >= 40


def test_an_interrupted_steps_kv_usage_sample_is_undone_with_it(monkeypatch):
    """A step interrupted as it commits is undone whole, its K/V usage sample too: the stats
    of the resumed run (usage mean and peak, steps, tokens) are an uninterrupted run's."""
    from vmemkv.runtime.transaction import Phase, StepTransaction

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batch = prompts(2, 5, 30, seed=8)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        engine.generate(batch, params)
        want = engine.stats()
    commit, recorded = StepTransaction.commit, []

    def interrupted_commit(self):
        if self.phase is Phase.EXECUTED:
            recorded.append(1)
            if len(recorded) == 2:      # the second step's recording, before its commit point
                raise KeyboardInterrupt
        commit(self)

    monkeypatch.setattr(StepTransaction, "commit", interrupted_commit)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        for prompt in batch:
            engine.add_request(prompt, params)
        with pytest.raises(KeyboardInterrupt):
            engine.run_until_done()
        engine.run_until_done()
        got = engine.stats()
    assert len(recorded) > 2
    assert (got.steps, got.output_tokens, got.kv_usage_peak) == \
        (want.steps, want.output_tokens, want.kv_usage_peak)
    assert got.kv_usage_mean == want.kv_usage_mean


def test_callbacks_raising_in_one_step_raise_the_first_ones_error_after_all_ran():
    """Two callbacks raise in the same step: both get their token, and the step raises the
    first one's error (in delivery order), not the last."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        seen = []

        def raising(name):
            def on_token(event):
                seen.append(name)
                raise ValueError(f"callback {name} failed")
            return on_token

        for name, prompt in zip("ab", prompts(2, 5, 9, seed=5)):
            engine.add_request(prompt, params, on_token=raising(name))
        with pytest.raises(ValueError, match="callback a failed"):
            engine.run_until_done()
    assert seen == ["a", "b"]


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_an_interrupt_before_a_plans_table_edits_reach_the_cache_loses_none(cache):
    """An interrupt as the cache is about to take a plan's table edits (its memory ops done):
    the step is forgotten, the memory kept, and the next plan sends the tables in full, so the
    resumed run has an uninterrupted run's tokens."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    batch = prompts(2, 5, 12, seed=9)
    with Engine(model(), cache=cache, **ENGINE) as engine:
        want = results(engine.generate(batch, params))
        apply_tables, calls = engine.runner.cache.apply_tables, []

        def interrupted(edits):
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return apply_tables(edits)

        engine.runner.cache.apply_tables = interrupted
        ids = [engine.add_request(p, params) for p in batch]
        with pytest.raises(KeyboardInterrupt):
            engine.run_until_done()
        engine.run_until_done()
        got = results([engine.output(rid, pop=True) for rid in ids])
        engine.cache.check_integrity()
    assert got == want
