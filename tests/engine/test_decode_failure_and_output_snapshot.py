"""A request's text that the tokenizer cannot decode fails that request alone, and what
``Engine.output`` hands a caller for a live request is a snapshot.

Before: a tokenizer whose ``decode`` raised (or returned None) on one request's token made the
step's recording raise, the step was undone, and every later step raised the same error: no
request ever finished and none was blamed. And ``output(rid)`` returned the running request's
own lists: a caller appending to ``token_ids`` changed what its penalties read next."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import BeamSearchParams, Engine, SamplingParams
from vmemkv.runtime.engine.errors import UnknownRequestError

from .conftest import model, prompts
from .test_request_fault_isolation import assert_released, samples

ENGINE = dict(max_batch=8, max_context=64, check_integrity=True, self_check=False)
PARAMS = [SamplingParams(max_new_tokens=8, ignore_eos=True),
          SamplingParams(max_new_tokens=6, temperature=0.9, seed=3, n=2, ignore_eos=True),
          SamplingParams(max_new_tokens=7, top_k=5, seed=4, ignore_eos=True)]


class FlakyTokenizer:
    """Decodes token t as one letter; ``decode`` of ids holding ``bad`` raises (``mode``
    "raise") or returns None (``mode`` "none")."""
    eos_token_id = None

    def __init__(self, mode: str) -> None:
        self.mode, self.bad = mode, None

    def __call__(self, text, **kwargs):
        return {"input_ids": [ord(c) % 256 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        if self.bad in ids:
            if self.mode == "raise":
                raise ValueError(f"cannot decode token {self.bad}")
            return None
        return "".join(chr(65 + t % 26) for t in ids)


def only_in_first(outputs_tokens: list, start: int) -> tuple:
    """(position, token) of the first token of ``outputs_tokens[0]`` from ``start`` on that no
    other list holds."""
    others = {t for ids in outputs_tokens[1:] for t in ids}
    return next((i, t) for i, t in enumerate(outputs_tokens[0]) if i >= start and t not in others)


@pytest.mark.parametrize("cache, mode", [("vmem", "raise"), ("paged", "none")])
def test_a_token_the_tokenizer_cannot_decode_fails_its_request_alone(cache, mode):
    tokenizer = FlakyTokenizer(mode)
    batch = prompts(3, 6, 14, seed=21)
    with Engine(model(), tokenizer=tokenizer, cache=cache, **ENGINE) as engine:
        want = engine.generate(batch, PARAMS)
        position, bad = only_in_first([c.token_ids for o in want for c in o.outputs], start=3)
        tokenizer.bad = bad
        out = engine.generate(batch, PARAMS)   # returns: the step no longer raises for ever
        assert_released(engine)                # its memory went back; nothing left queued
        tokenizer.bad = None
        again = engine.generate(batch, PARAMS)   # the engine goes on as before
    failed = out[0]
    assert failed.status == "failed" and failed.error.type == "TokenDecodeError"
    assert failed.error.message.startswith(f"request {failed.request_id}: the tokenizer's decode")
    assert f"ending with token {bad})" in failed.error.message
    what = "raised ValueError: cannot decode" if mode == "raise" else "returned NoneType, not a str"
    assert what in failed.error.message
    kept = want[0].outputs[0].token_ids[:position]   # the tokens recorded before the bad one
    assert failed.outputs[0].token_ids == kept and failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].text == tokenizer.decode(kept)
    assert [o.status for o in out[1:]] == ["finished"] * 2
    assert samples(out[1:]) == samples(want[1:]) and samples(again) == samples(want)
    assert [c.text for o in out[1:] for c in o.outputs] == \
        [c.text for o in want[1:] for c in o.outputs]


def test_a_beam_search_whose_text_cannot_be_decoded_fails_alone():
    tokenizer = FlakyTokenizer("raise")
    batch = prompts(2, 6, 10, seed=5)
    params = BeamSearchParams(2, max_new_tokens=5, ignore_eos=True)
    with Engine(model(), tokenizer=tokenizer, cache="vmem", **ENGINE) as engine:
        want = engine.beam_search(batch, params)
        beams = [[c.token_ids for c in o.outputs] for o in want]
        _, bad = only_in_first([sum(beams[0], []), sum(beams[1], [])], start=0)
        tokenizer.bad = bad
        out = engine.beam_search(batch, params)
        assert_released(engine)
    assert out[0].status == "failed" and out[0].error.type == "TokenDecodeError"
    assert out[0].error.message.startswith(f"request {out[0].request_id}: the tokenizer's decode")
    assert f"cannot decode token {bad}" in out[0].error.message
    assert out[1].status == "finished"
    assert [(c.token_ids, c.beam_score, c.text) for c in out[1].outputs] == \
        [(c.token_ids, c.beam_score, c.text) for c in want[1].outputs]


def test_an_edit_to_a_live_requests_output_changes_nothing_the_engine_does():
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.5,
                            logprobs=1)
    with Engine(model(), **ENGINE) as engine:
        (want,) = engine.generate([[1, 2, 3]], params)
        rid = engine.add_request([1, 2, 3], params)
        engine.step()
        engine.step()
        mid = engine.output(rid)            # read while it runs, not popped
        assert mid.outputs[0].token_ids == want.outputs[0].token_ids[:2]
        mid.outputs[0].token_ids.append(42)    # the caller edits what it was handed
        mid.outputs[0].token_times_s.clear()
        mid.outputs[0].logprobs.clear()
        mid.outputs.clear()
        engine.run_until_done()
        out = engine.output(rid, pop=True)
    assert out.status == "finished" and len(out.outputs) == 1
    assert out.outputs[0].token_ids == want.outputs[0].token_ids   # penalties read no 42
    assert len(out.outputs[0].token_times_s) == 8
    assert out.outputs[0].logprobs == want.outputs[0].logprobs      # the engine's, not cleared


def test_popping_a_live_requests_output_forgets_nothing():
    """``output(rid, pop=True)`` forgets an ended request only: a live one's pop is a snapshot,
    and the request runs on to its whole output, which a later pop then forgets."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with Engine(model(), **ENGINE) as engine:
        (want,) = engine.generate([[1, 2, 3]], params)
        rid = engine.add_request([1, 2, 3], params)
        engine.step()
        engine.step()
        mid = engine.output(rid, pop=True)
        assert mid.outputs[0].token_ids == want.outputs[0].token_ids[:2]
        assert engine.status(rid) == "running"
        engine.run_until_done()
        out = engine.output(rid, pop=True)
        with pytest.raises(UnknownRequestError):
            engine.output(rid)
    assert out.status == "finished" and out.outputs[0].token_ids == want.outputs[0].token_ids
