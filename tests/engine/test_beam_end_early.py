"""A beam request that ends early (aborted, closed, failed) returns what it has as a done search
does: every returned beam scored alike (``beam_score`` = cumulative logprob / tokens **
length_penalty, a live beam's too) and best first, finished hypotheses and live beams merged.
Before, a live beam's beam_score was its raw cumulative logprob and the finished hypotheses came
first, unsorted."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams

from .conftest import model

STOP_IDS = tuple(range(0, 256, 8))


def ended(params, steps, close=False):
    """The output of a beam request on [5, 6, 7] aborted (or closed) after ``steps`` steps."""
    engine = Engine(model("tiny-llama"), max_batch=8, max_context=64)
    with engine:
        rid = engine.add_beam_request([5, 6, 7], params)
        for _ in range(steps):
            engine.step()
        assert engine.status(rid) == ("running" if steps else "waiting")
        if not close:
            return engine.abort(rid)
    return engine.output(rid)


def test_a_live_beams_score_has_the_length_penalty():
    out = ended(BeamSearchParams(3, max_new_tokens=20, length_penalty=2.0, ignore_eos=True), 5)
    assert out.status == "aborted" and len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "abort" and len(c.token_ids) == 5
        # it was the cumulative logprob itself (-13.688 for the best)
        assert c.beam_score == pytest.approx(c.cumulative_logprob / 5 ** 2.0, rel=1e-5)
    assert out.outputs[0].beam_score == pytest.approx(-0.5475, abs=1e-3)
    scores = [c.beam_score for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    # before its first token: one empty beam, scored 0.0 (no tokens ** -1 to divide by)
    out = ended(BeamSearchParams(2, max_new_tokens=4, length_penalty=-1.0), 0)
    assert [(c.token_ids, c.beam_score, c.finish_reason) for c in out.outputs] == \
        [([], 0.0, "abort")]


@pytest.mark.parametrize("close", [False, True])
def test_finished_hypotheses_and_live_beams_are_ranked_together_best_first(close):
    # after 7 steps a 7-token hypothesis ended by a stop id (-2.909) ranks 4th, behind three
    # live beams (-2.834, -2.876, -2.881); a 1-token one (-3.696) is cut. It had come first.
    params = BeamSearchParams(4, max_new_tokens=20, ignore_eos=True, stop_token_ids=STOP_IDS)
    out = ended(params, 7, close)
    assert out.status == "aborted"
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort", "abort", "stop"]
    scores = [c.beam_score for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert scores == pytest.approx([-2.8341, -2.8763, -2.8811, -2.9092], abs=1e-3)
    for c in out.outputs:
        assert c.beam_score == pytest.approx(c.cumulative_logprob / len(c.token_ids), rel=1e-5)



def test_an_interrupt_in_the_step_a_beam_search_is_done_undoes_its_end(monkeypatch):
    """The step that finishes a beam search is interrupted while it is recorded (after its
    output is filled): the step is undone whole, the request live again (not "finished" with
    no beams), and the resumed run returns an uninterrupted run's beams."""
    from vmemkv.runtime.engine.engine import Engine as EngineClass

    params = BeamSearchParams(2, max_new_tokens=4, ignore_eos=True)
    prompt = [1, 2, 3, 4, 5]
    with Engine(model(), cache="vmem", max_batch=4, max_context=64) as engine:
        (want,) = engine.beam_search([prompt], params)
        count_finished, interrupted = EngineClass._count_finished, []

        def interrupted_count(self, events):
            if any(event.finished for event in events) and not interrupted:
                interrupted.append(1)
                raise KeyboardInterrupt
            return count_finished(self, events)

        monkeypatch.setattr(EngineClass, "_count_finished", interrupted_count)
        rid = engine.add_beam_request(prompt, params)
        with pytest.raises(KeyboardInterrupt):
            engine.run_until_done()
        assert engine.status(rid) == "running" and engine.output(rid).outputs == []
        engine.run_until_done()
        got = engine.output(rid, pop=True)
    assert got.status == "finished"
    assert [(c.token_ids, c.beam_score) for c in got.outputs] == \
        [(c.token_ids, c.beam_score) for c in want.outputs]
