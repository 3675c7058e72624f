"""Beam searches under the blame contract: a beam request is a candidate as a sample is, so a
sampler fault of another request, or a beam selection that raises for one group, fails that
request alone and the others (beam searches included) produce exactly their solo tokens; and
any finite length_penalty is scored without overflow."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import BeamSearchParams, Engine, SamplingParams, beam

from .conftest import model, prompts
from .test_request_fault_isolation import (BAD_SEED, ENGINE, assert_released,
                                           sampler_fault)  # noqa: F401 -- a fixture

BAD_PENALTY = 0.666                 # the faulty beam search's marker
BEAMS = BeamSearchParams(2, max_new_tokens=6, ignore_eos=True)
PLAIN = SamplingParams(max_new_tokens=6, ignore_eos=True)


def run(engine, requests) -> list:
    """``requests``: [(prompt, SamplingParams or BeamSearchParams)], queued together, run to
    the end; their outputs."""
    ids = [engine.add_beam_request(p, s) if isinstance(s, BeamSearchParams)
           else engine.add_request(p, s) for p, s in requests]
    engine.run_until_done()
    return [engine.output(rid, pop=True) for rid in ids]


def beams(output) -> list:
    return [(c.token_ids, c.beam_score) for c in output.outputs]


def test_a_sampler_fault_fails_its_request_alone_beside_a_beam_search(sampler_fault):
    """Only the beam search and the faulty sample were in the step: the beam rows were no
    blame candidates, so "every candidate fails alone" held, nobody was blamed and the fault
    reached the caller (the server aborted the innocent beam search: a 500)."""
    beam_prompt, victim_prompt = prompts(2, 5, 9, seed=31)
    victim = SamplingParams(max_new_tokens=4, temperature=1.0, seed=BAD_SEED)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        (want,) = run(engine, [(beam_prompt, BEAMS)])
        innocent, failed = run(engine, [(beam_prompt, BEAMS), (victim_prompt, victim)])
        assert_released(engine)
    assert failed.status == "failed" and "injected sampler fault" in failed.error.message
    assert innocent.status == "finished" and beams(innocent) == beams(want)


@pytest.fixture
def selection_fault(monkeypatch):
    """Beam selection raises for every group whose length_penalty is BAD_PENALTY."""
    real = beam.select

    def faulty(group, logprobs):
        if group.params.length_penalty == BAD_PENALTY:
            raise RuntimeError("injected selection fault")
        return real(group, logprobs)

    monkeypatch.setattr(beam, "select", faulty)


def test_a_beam_selection_that_raises_fails_its_beam_search_alone(selection_fault):
    """One beam group's selection raises: that beam search alone ends "failed"; a plain
    request and another beam search finish with their solo tokens (nobody was blamed: the
    beam rows were no candidates, the fault reached the caller)."""
    bad = BeamSearchParams(2, max_new_tokens=6, ignore_eos=True, length_penalty=BAD_PENALTY)
    bad_prompt, beam_prompt, plain_prompt = prompts(3, 5, 9, seed=32)
    with Engine(model(), cache="paged", block_size=4, **ENGINE) as engine:
        want = run(engine, [(beam_prompt, BEAMS), (plain_prompt, PLAIN)])
        failed, innocent, plain = run(engine, [(bad_prompt, bad), (beam_prompt, BEAMS),
                                               (plain_prompt, PLAIN)])
        assert_released(engine)
    assert failed.status == "failed" and "injected selection fault" in failed.error.message
    assert innocent.status == plain.status == "finished"
    assert beams(innocent) == beams(want[0])
    assert plain.outputs[0].token_ids == want[1].outputs[0].token_ids


@pytest.mark.parametrize("length_penalty", [2000.0, -2000.0, 10**300])
def test_any_finite_length_penalty_is_scored_without_overflow(length_penalty):
    """tokens ** 2000.0 raised OverflowError inside the step (nobody was blamed: the server
    aborted every live request). Past a float's range the divisor is +inf, and the scores are
    what float32 makes of any divisor past its range: -0.0 (or -inf for a divisor of 0)."""
    params = BeamSearchParams(2, max_new_tokens=4, ignore_eos=True, length_penalty=length_penalty)
    prompt, plain_prompt = prompts(2, 5, 9, seed=33)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        (solo,) = run(engine, [(plain_prompt, PLAIN)])
        out, plain = run(engine, [(prompt, params), (plain_prompt, PLAIN)])
        assert_released(engine)
    assert out.status == plain.status == "finished"
    assert plain.outputs[0].token_ids == solo.outputs[0].token_ids
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 4 for c in out.outputs)
    expected = 0.0 if length_penalty > 0 else float("-inf")
    assert all(c.beam_score == expected for c in out.outputs)
