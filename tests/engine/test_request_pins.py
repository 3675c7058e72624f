"""Pins of what a request's entry and ending promise (a mutation audit): an aborted request's
K/V stay findable while a failed one that was never admitted drops nothing of others', a seed
of 0 is a seed, prompts refuse bools, a request with some samples unfinished is unfinished, a
batch interrupted while added leaves no sample state, check_admissible refuses what
add_request would, a negative count is refused."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, EngineConfigError, RequestRejectedError, SamplingParams
from vmemkv.runtime.engine.call_checks import check_count
from vmemkv.runtime.engine.outputs import CompletionOutput, RequestOutput
from vmemkv.runtime.engine.prompts import encode_prompt

from .conftest import model
from .test_failed_waiting_prefix_dropped import fail_next_step_naming

PROMPT = list(range(10, 58))          # 48 tokens: three 16-token blocks
PLAIN = SamplingParams(max_new_tokens=2, ignore_eos=True)
SHARING = dict(cache="paged", block_size=16, max_batch=2, max_context=96, prefix_sharing=True)


def _hits_of_the_prompt_again(engine) -> int:
    """Prefix-cache hits of a new request for PROMPT, run to its end."""
    before = engine.kv.manager.prefix_hits
    engine.generate([PROMPT], PLAIN)
    return engine.kv.manager.prefix_hits - before


def test_an_aborted_requests_computed_prefix_stays_findable():
    with Engine(model(), **SHARING) as engine:
        rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
        while not engine.output(rid).outputs[0].token_ids:
            engine.step()                                  # its prompt computed
        assert engine.abort(rid).status == "aborted"
        assert _hits_of_the_prompt_again(engine) == 32     # every full block but the last's
        # token (the last prompt token is always computed)


def test_a_request_failed_before_admission_drops_nothing_another_published():
    with Engine(model(), **SHARING) as engine:
        engine.generate([PROMPT], PLAIN)                   # publishes the prompt's blocks
        failing = engine.add_request(PROMPT, PLAIN)
        fail_next_step_naming(engine, failing)
        engine.step()
        assert engine.output(failing).status == "failed"
        assert _hits_of_the_prompt_again(engine) == 32


def test_seed_zero_is_a_seed_whatever_else_is_in_the_batch():
    """Two requests with seed 0 draw the same tokens (0 was read as "no seed": each drew from
    the engine's generator)."""
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0, ignore_eos=True)
    with Engine(model(), cache="vmem", max_batch=4, max_context=64) as engine:
        first, second = engine.generate([[5, 6, 7], [5, 6, 7]], params)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


@pytest.mark.parametrize("prompt", [[5, True], (False, 7)])
def test_a_bool_in_a_prompt_is_refused_naming_its_type(prompt):
    with pytest.raises(RequestRejectedError, match="prompt 3 must be text or a list of int "
                                                   "token ids, got bool"):
        encode_prompt(prompt, 3, None, 256)


def test_a_request_is_finished_only_when_every_sample_is():
    out = RequestOutput(0, (1,), [CompletionOutput(0, [4], "stop"), CompletionOutput(1, [4])])
    assert not out.finished
    out.outputs[1].finish_reason = "length"
    assert out.finished


def test_a_batch_interrupted_while_added_leaves_no_sample_state():
    """add_all withdraws the prompts it added: their sample and prompt-logprobs records too."""
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=1, temperature=1.0)
    with Engine(model(), cache="vmem", max_batch=4, max_context=64) as engine:
        def add(i):
            if i == 1:
                raise KeyboardInterrupt
            return engine.add_request([5, 6, 7], params)
        with pytest.raises(KeyboardInterrupt):
            engine.add_all(add, 2)
        assert not engine.has_unfinished()
        assert (engine._requests, engine._samples, engine._prompt_logprobs) == ({}, {}, {})


def test_check_admissible_refuses_a_min_tokens_mask_over_the_whole_vocabulary():
    every_id = SamplingParams(max_new_tokens=4, min_tokens=2, stop_token_ids=tuple(range(256)))
    with Engine(model(), cache="vmem", max_batch=4, max_context=64) as engine:
        with pytest.raises(RequestRejectedError, match="prompt 1: min_tokens 2") as error:
            engine.check_admissible([[1, 2], [3, 4]], [SamplingParams(), every_id])
        assert error.value.field == "min_tokens" and not engine.has_unfinished()


def test_a_negative_count_is_refused_naming_it():
    """add_all's count: range(-1) added nothing, silently."""
    check_count("add_all: count", 0)
    with pytest.raises(EngineConfigError, match=r"add_all: count must be an int >= 0, got int -1"):
        check_count("add_all: count", -1)
