"""min_tokens whose mask would cover the whole vocabulary (every token a stop id) has no token
to give: the sampler refuses by name instead of drawing from nothing (torch.multinomial on all
-inf raised a RuntimeError) or returning token 0, a stop id, against min_tokens (greedy)."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.runtime.engine.sampler import SampleState, Sampler, check_min_tokens

from .conftest import VOCAB, model, prompts
from .test_request_fault_isolation import ENGINE, assert_released

EVERY_ID = tuple(range(VOCAB))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_min_tokens_mask_over_the_whole_vocabulary_is_refused_naming_min_tokens(temperature):
    params = SamplingParams(max_new_tokens=4, min_tokens=2, temperature=temperature, seed=1)
    state = SampleState(0, params, torch.Generator().manual_seed(1), stop_ids=EVERY_ID)
    with pytest.raises(RequestRejectedError, match="min_tokens") as error:
        Sampler().sample(torch.randn(1, VOCAB), [state])
    assert error.value.field == "min_tokens"
    one_free = SampleState(0, params, torch.Generator().manual_seed(1), stop_ids=EVERY_ID[1:])
    assert Sampler().sample(torch.randn(1, VOCAB), [one_free]) == [0]   # the one id left


def test_check_min_tokens_counts_ids_in_the_vocabulary_and_only_with_min_tokens():
    params = SamplingParams(max_new_tokens=4, min_tokens=1)
    check_min_tokens(params, EVERY_ID[1:] + (VOCAB, VOCAB + 1), VOCAB)      # id 0 stays free
    check_min_tokens(SamplingParams(max_new_tokens=4), EVERY_ID, VOCAB)    # nothing masked
    with pytest.raises(RequestRejectedError):
        check_min_tokens(params, EVERY_ID + EVERY_ID, VOCAB)


def test_such_a_request_is_refused_at_submission_naming_min_tokens_and_nothing_changes():
    """Greedy, it 'finished' after one token 0 (a stop id) with min_tokens 2; then the sampler
    failed it in its first step. add_request and generate refuse it before anything is
    queued (generate's batch is all or nothing), and the engine serves the next batch exactly."""
    bad = SamplingParams(max_new_tokens=4, min_tokens=2, stop_token_ids=EVERY_ID)
    good = SamplingParams(max_new_tokens=6, ignore_eos=True)
    batch = prompts(3, 4, 9, seed=41)
    with Engine(model(), cache="vmem", **ENGINE) as engine:
        want = engine.generate(batch[1:], good)
        with pytest.raises(RequestRejectedError, match="prompt 1: min_tokens 2") as error:
            engine.generate(batch, [good, bad, good])
        assert error.value.field == "min_tokens" and error.value.index == 1
        with pytest.raises(RequestRejectedError, match="min_tokens"):
            engine.add_request(batch[0], bad)
        assert not engine.has_unfinished()
        assert_released(engine)
        out = engine.generate(batch[1:], good)
    assert [o.outputs[0].token_ids for o in out] == [w.outputs[0].token_ids for w in want]
