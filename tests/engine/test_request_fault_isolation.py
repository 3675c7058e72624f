"""The blame contract beyond memory plans: when the model's forward or the sampler raises for
one request, that request alone ends "failed" (``RequestOutput.error`` set, memory released)
and every other request produces exactly the tokens of a run without it. The engine finds the
culprit by running the failed step's work one sequence at a time; a fault it cannot blame on a
request (nothing fails alone, or everything does) reaches the caller with nothing lost."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.sampler import Sampler

from .conftest import model, prompts, tokens

ENGINE = dict(max_batch=8, max_context=64, check_integrity=True)
BAD_SEED = 666                      # the victim's sampling marker
PATTERN = (251, 252, 253)           # the victim's prompt marker (no other prompt holds it)
GOOD = [SamplingParams(max_new_tokens=8, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=0.9, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_new_tokens=7, top_k=5, seed=4, ignore_eos=True)]


def others():
    batch = prompts(3, 6, 14, seed=21)
    assert not any(has_pattern(p) for p in batch)
    return batch


def has_pattern(ids) -> bool:
    ids = list(ids)
    return any(tuple(ids[i:i + 3]) == PATTERN for i in range(len(ids) - 2))


def samples(outputs) -> list:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_released(engine) -> None:
    engine.kv.manager.check_integrity()
    engine.cache.check_integrity()
    assert engine.kv.manager.stats().live_tokens == 0 and not engine.has_unfinished()


@pytest.fixture
def sampler_fault(monkeypatch):
    """The sampler raises for every row of a request seeded BAD_SEED; counts the raises."""
    one, raised = Sampler._one, []

    def faulty(row, sample):
        if sample.params.seed == BAD_SEED:
            raised.append(1)
            raise RuntimeError("injected sampler fault")
        return one(row, sample)

    monkeypatch.setattr(Sampler, "_one", staticmethod(faulty))
    return raised


def forward_fault(monkeypatch, m, times: int = 10**9) -> list:
    """``m``'s forward raises while a batch holds the victim's prompt (``times`` times)."""
    forward, raised = m.forward, []

    def faulty(*args, input_ids=None, **kwargs):
        if has_pattern(input_ids[0].tolist()) and len(raised) < times:
            raised.append(1)
            raise RuntimeError("injected forward fault")
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(m, "forward", faulty)
    return raised


@pytest.mark.parametrize("retries", [0, 2])
def test_a_request_whose_sampling_fails_fails_alone_and_the_others_are_exact(sampler_fault, retries):
    victim = SamplingParams(max_new_tokens=8, temperature=1.0, seed=BAD_SEED)
    with Engine(model(), cache="vmem", max_plan_retries=retries, **ENGINE) as engine:
        want = samples(engine.generate(others(), GOOD))
        assert not sampler_fault
        out = engine.generate([prompts(1, 8, 8, seed=22)[0]] + others(), [victim] + GOOD)
        assert len(sampler_fault) == 1 + retries + 1   # the batch, then alone retries + 1 times
        assert_released(engine)
        again = samples(engine.generate(others(), GOOD))   # nothing of it is left queued
    failed = out[0]
    assert failed.status == "failed" and failed.error.type == "RuntimeError"
    assert "injected sampler fault" in failed.error.message
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert [o.status for o in out[1:]] == ["finished"] * 3
    assert samples(out[1:]) == want == again


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_a_request_whose_forward_fails_fails_alone_and_the_others_are_exact(monkeypatch, cache):
    m = model()
    victim_prompt = [7, 8, *PATTERN, 9, 10]
    with Engine(m, cache=cache, **ENGINE) as engine:
        want = samples(engine.generate(others(), GOOD))
        raised = forward_fault(monkeypatch, m)
        out = engine.generate([victim_prompt] + others(), [GOOD[0]] + GOOD)
        assert len(raised) == 1 + engine.config.max_plan_retries + 1
        assert_released(engine)
    assert out[0].status == "failed" and "injected forward fault" in out[0].error.message
    assert [o.status for o in out[1:]] == ["finished"] * 3 and samples(out[1:]) == want


def test_a_fault_that_fails_alone_but_alone_in_the_batch_is_raised_then_blamed(sampler_fault):
    """Alone in the engine a request's fault cannot be told from the engine's: it is raised and
    the request stays queued, intact; once it shares a step, it is blamed and failed."""
    victim = SamplingParams(max_new_tokens=8, temperature=1.0, seed=BAD_SEED)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        want = tokens(engine.generate(others()[:1], GOOD[:1]))
        rid = engine.add_request(prompts(1, 8, 8, seed=22)[0], victim)
        with pytest.raises(RuntimeError, match="injected sampler fault"):
            engine.run_until_done()
        assert engine.status(rid) == "running" and engine.output(rid).outputs[0].token_ids == []
        out = engine.generate(others()[:1], GOOD[:1])
        assert engine.output(rid, pop=True).status == "failed"
        assert_released(engine)
    assert tokens(out) == want


def test_a_transient_forward_fault_is_raised_then_the_run_resumes_exactly(monkeypatch):
    """A fault that does not repeat alone is nobody's: it reaches the caller, nothing lost."""
    m = model()
    batch = [[7, 8, *PATTERN, 9, 10]] + others()
    with Engine(m, cache="vmem", **ENGINE) as engine:
        want = samples(engine.generate(batch, [GOOD[0]] + GOOD))
        forward_fault(monkeypatch, m, times=1)
        ids = [engine.add_request(p, s) for p, s in zip(batch, [GOOD[0]] + GOOD)]
        with pytest.raises(RuntimeError, match="injected forward fault"):
            engine.run_until_done()
        engine.run_until_done()
        out = [engine.output(rid, pop=True) for rid in ids]
        assert_released(engine)
    assert [o.status for o in out] == ["finished"] * 4 and samples(out) == want


@pytest.mark.parametrize("victim", [GOOD[0], GOOD[1]], ids=["greedy", "sampled-n2"])
def test_nan_logits_fail_their_request_alone_not_as_token_0(monkeypatch, victim):
    """Logits holding NaN (a model's numeric overflow) were argmax'ed to token 0, silently:
    the rows are refused (NonFiniteLogitsError) and their request alone fails."""
    m = model()
    victim_prompt = [7, 8, *PATTERN]          # its first sampled row ends with the pattern
    forward = m.forward

    def nan_rows(*args, input_ids=None, logits_to_keep=None, **kwargs):
        out = forward(*args, input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        ids = input_ids[0].tolist()
        for i, row in enumerate(logits_to_keep.tolist()):
            if row >= 2 and tuple(ids[row - 2:row + 1]) == PATTERN:
                out.logits[0, i, 5] = float("nan")
        return out

    with Engine(m, cache="vmem", **ENGINE) as engine:
        want = samples(engine.generate(others(), GOOD))
        monkeypatch.setattr(m, "forward", nan_rows)
        out = engine.generate([victim_prompt] + others(), [victim] + GOOD)
        assert_released(engine)
    assert out[0].status == "failed" and out[0].error.type == "NonFiniteLogitsError"
    assert "logits hold NaN or inf" in out[0].error.message
    assert all(c.token_ids == [] for c in out[0].outputs)
    assert [o.status for o in out[1:]] == ["finished"] * 3 and samples(out[1:]) == want
