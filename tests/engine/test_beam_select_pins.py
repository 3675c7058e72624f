"""Pins of beam search's selection rule on hand-made logprobs (a mutation audit): at most
beam_width hypotheses kept, the early-stopping heuristic on a tie and with "never", the ranks
of the chosen tokens, an early end's order on a tie (a finished hypothesis first) and count,
and the refusal of a search needing more candidates than the vocabulary has."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime.engine.beam import BeamSearches, BeamSearching
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.beam_select import Beam, GroupState, Hypothesis, select
from vmemkv.runtime.engine.errors import BeamSearchParamsError
from vmemkv.runtime.engine.outputs import RequestOutput
from vmemkv.runtime.engine.request_state import RequestState
from vmemkv.runtime.engine.sampling import SamplingParams

STOP = 0          # the one stop id
LOW = -100.0      # a logprob no candidate that matters comes near


def _first_step(params: BeamSearchParams) -> GroupState:
    """One beam (the prompt), scores [-1, -2, -3, -10]: token 0 (a stop id) ends a hypothesis
    at -1, tokens 1 and 2 run on at -2 and -3."""
    group = GroupState(params, (STOP,), (Beam(7, (), (), 0.0),))
    group = select(group, torch.tensor([[-1.0, -2.0, -3.0, -10.0]]))
    assert [b.token_ids for b in group.beams] == [(1,), (2,)] and not group.done
    assert [(h.token_ids, h.score) for h in group.hyps] == [((0,), -1.0)]
    return group


def _tie_step(params: BeamSearchParams) -> GroupState:
    """Beam (1,) ends at -3 (-1.5 over 2 tokens); beam (2,) runs on at -3: its score at today's
    length, -1.5, ties the worst hypothesis'."""
    return select(_first_step(params), torch.tensor([[-1.0, LOW, LOW, LOW],
                                                     [LOW, 0.0, LOW, LOW]]))


def test_a_tie_with_the_worst_hypothesis_ends_the_search():
    """transformers: done once no running beam can beat (strictly) the worst kept hypothesis."""
    group = _tie_step(BeamSearchParams(2, max_new_tokens=10))
    assert group.done and group.beams == ()
    assert [h.score for h in group.hyps] == [-1.0, -1.5]


def test_never_with_a_positive_length_penalty_judges_a_beam_at_max_new_tokens():
    """early_stopping="never": the running beam could reach -3 / 10 tokens = -0.3 > -1.5."""
    group = _tie_step(BeamSearchParams(2, max_new_tokens=10, early_stopping="never"))
    assert not group.done
    assert [b.token_ids for b in group.beams][0] == (2, 1)


def test_at_most_beam_width_hypotheses_are_kept_and_early_stopping_ends_at_that_many():
    """Both beams end this step: 3 hypotheses, the best 2 kept, and early_stopping=True is done."""
    first = _first_step(BeamSearchParams(2, max_new_tokens=10, early_stopping=True))
    group = select(first, torch.tensor([[-0.1, LOW, LOW, LOW], [-0.1, -0.5, LOW, LOW]]))
    assert group.done and group.ended_now == 2
    assert [(h.token_ids, round(h.score, 4)) for h in group.hyps] == [((0,), -1.0),
                                                                      ((1, 0), -1.05)]


def test_each_chosen_token_has_its_rank_in_its_own_beams_distribution():
    group = _first_step(BeamSearchParams(2, max_new_tokens=10))
    assert [b.logprobs[-1].rank for b in group.beams] == [2, 3]
    assert group.hyps[0].logprobs[-1].rank == 1
    ties = select(group, torch.tensor([[-1.0, -1.0, LOW, LOW], [-1.0, -1.0, LOW, LOW]]))
    assert all(h.logprobs[-1].rank == 1 for h in ties.hyps)
    assert all(b.logprobs[-1].rank == 1 for b in ties.beams)


class _Ending(BeamSearching):
    """The fields ``_end_beams`` and ``check_beam_params`` read: one beam request, no
    tokenizer, a 256-token vocabulary whose EOS is id 2, max_batch 8."""

    def __init__(self, group: GroupState) -> None:
        self.tokenizer, self._beams = None, BeamSearches()
        self.vocab_size, self.eos_ids, self.config = 256, (2,), SimpleNamespace(max_batch=8)
        self._beams.groups[0] = group
        self._requests = {0: RequestState(RequestOutput(0, (5,), []), SamplingParams(), None, 1)}


def test_an_early_end_ranks_a_finished_hypothesis_first_on_a_tie():
    """A live beam at -2 over 2 tokens ties the finished hypothesis at -1: the finished first."""
    live = Beam(3, (1, 2), (), -2.0)
    done = Hypothesis((4, STOP), (), -1.0, "stop")
    ending = _Ending(GroupState(BeamSearchParams(2), (STOP,), (live,), (done,)))
    ending._end_beams(0, "abort")
    outputs = ending._requests[0].output.outputs
    assert [(c.token_ids, c.finish_reason, c.beam_score) for c in outputs] == [
        ([4, STOP], "stop", -1.0), ([1, 2], "abort", -1.0)]


def test_an_early_end_returns_num_return_beams():
    beams = (Beam(3, (1, 2), (), -2.0), Beam(4, (1, 3), (), -3.0))
    ending = _Ending(GroupState(BeamSearchParams(2, num_return_beams=1), (STOP,), beams))
    ending._end_beams(0, "abort")
    assert [c.token_ids for c in ending._requests[0].output.outputs] == [[1, 2]]


def test_a_search_needing_more_candidates_than_the_vocabulary_is_refused():
    """256 stop ids and one beam: 257 candidates a step, one more than the 256 tokens."""
    checks = _Ending(GroupState(BeamSearchParams(1), (), ()))
    checks.check_beam_params(BeamSearchParams(1, ignore_eos=True,
                                              stop_token_ids=tuple(range(255))))   # 256: fits
    with pytest.raises(BeamSearchParamsError, match="needs 257 candidates") as error:
        checks.check_beam_params(BeamSearchParams(1, ignore_eos=True,
                                                  stop_token_ids=tuple(range(256))))
    assert error.value.field == "beam_width"


def test_beam_stop_token_ids_past_the_vocabulary_are_refused_by_name():
    checks = _Ending(GroupState(BeamSearchParams(1), (), ()))
    checks.check_beam_params(BeamSearchParams(2, stop_token_ids=(255,)))
    with pytest.raises(BeamSearchParamsError, match=r"\[256\] lie outside") as error:
        checks.check_beam_params(BeamSearchParams(2, stop_token_ids=(255, 256)))
    assert error.value.field == "stop_token_ids"
