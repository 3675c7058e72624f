"""Fixes from the sampling audit: stop strings wait for ``min_tokens`` (as vLLM's detokenizer),
a row whose processed scores all overflow to -inf is refused naming the field (never token 0 or
torch's RuntimeError), and numpy scalars are taken as Python numbers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vmemkv.runtime.engine import (EngineConfigError, Engine, RequestRejectedError,
                                   SamplingParams)
from vmemkv.runtime.engine.detokenize import IncrementalText
from vmemkv.runtime.engine.sampler import SampleState, processed_scores

from .byte_tokenizer import byte_tokenizer
from .conftest import VOCAB, model

SENTENCE = " is Paris. The capital of Germany is Berlin."
X = ord("x")
FORCE_X = {X: 100.0}


def _fed(stop, min_tokens: int, include: bool = False) -> tuple:
    """(text, deltas joined, tokens taken) of SENTENCE fed byte by byte, streamed."""
    tok = byte_tokenizer()
    ids = tok(SENTENCE)["input_ids"]
    assert len(ids) == len(SENTENCE)            # one token per ASCII character
    text, sent = IncrementalText(tok, stop, include, min_tokens=min_tokens), ""
    for i, token in enumerate(ids):
        sent += text.add(token, last=i == len(ids) - 1)
        if text.stopped:
            break
    return text.text, sent, len(text.token_ids)


@pytest.mark.parametrize("stop, min_tokens, want_text, want_tokens", [
    (["."], 0, " is Paris", 10),
    (["."], 9, " is Paris", 10),             # "." is token 10: 10 > 9, looked for
    (["."], 10, " is Paris. The capital of Germany is Berlin", 44),   # token 10 <= 10: not
    (["Paris"], 8, " is ", 9),               # ends on token 9
    (["Paris"], 9, SENTENCE, 44),            # complete by token 9: never counts
    (["Germany"], 30, " is Paris. The capital of ", 33),   # starts on token 27, ends on 33
    (["is", "Germany"], 5, " is Par", 9),    # the "is" ending on token 3 does not count
])
def test_stop_strings_wait_for_min_tokens_as_vllm(stop, min_tokens, want_text, want_tokens):
    """vLLM looks for stop strings only once the output has more than min_tokens tokens; the
    engine ended at the first stop string whatever min_tokens said."""
    text, sent, tokens = _fed(stop, min_tokens)
    assert (text, tokens) == (want_text, want_tokens)
    assert sent == text


def test_a_restored_step_ends_as_the_uninterrupted_one():
    """A step that is not recorded (``restore``) leaves the min_tokens boundary as it was."""
    text = IncrementalText(byte_tokenizer(), ["ab"], min_tokens=2)
    for token in b"ab":
        text.add(token)                        # "ab" complete within min_tokens: no stop
    saved = text.save()
    text.add(ord("a"))
    text.restore(saved)
    deltas = [text.add(token) for token in b"cab"]
    assert text.stopped and text.text == "abc" and text.token_ids == list(b"abcab")
    assert deltas == ["b", "c", ""]


def test_engine_stop_string_waits_for_min_tokens_as_stop_token_ids_do():
    """The audit's repro: min_tokens=6, stop=["x"], 'x' forced gave 1 token and text ''."""
    prompt = [ord(c) for c in "abc"]
    base = dict(max_new_tokens=10, min_tokens=6, logit_bias=FORCE_X, ignore_eos=True)
    with Engine(model(), byte_tokenizer(), max_batch=4, max_context=64) as engine:
        by_string, by_id = engine.generate([prompt, prompt], [
            SamplingParams(stop=["x"], **base), SamplingParams(stop_token_ids=[X], **base)])
    got = by_string.outputs[0]
    assert got.token_ids == [X] * 7 and got.finish_reason == "stop"
    assert got.text == "x" * 6                   # the 7th x is the stop string, cut
    assert len(by_id.outputs[0].token_ids) == 7


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scores_all_overflowing_to_minus_inf_fail_the_request_naming_the_field(temperature):
    """logit_bias -100 on every token and repetition_penalty 1e38 (both in range), every token
    in the prompt: greedy returned token 0 as if fine, sampled failed with torch's RuntimeError.
    The neighbour is untouched."""
    bad = SamplingParams(max_new_tokens=3, temperature=temperature, seed=1, ignore_eos=True,
                         logit_bias={t: -100.0 for t in range(VOCAB)}, repetition_penalty=1e38)
    plain = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with Engine(model(), max_batch=4, max_context=300) as engine:
        failed, neighbour = engine.generate([list(range(VOCAB)), [5, 6, 7]], [bad, plain])
        alone = engine.generate([[5, 6, 7]], plain)[0]
    assert failed.status == "failed" and failed.outputs[0].token_ids == []
    assert (failed.error.type, failed.error.field) == ("RequestRejectedError", "repetition_penalty")
    assert "repetition_penalty" in failed.error.message
    assert neighbour.status == "finished"
    assert neighbour.outputs[0].token_ids == alone.outputs[0].token_ids


def test_processed_scores_refuse_an_all_minus_inf_row_but_keep_a_partial_overflow():
    params = SamplingParams(repetition_penalty=1e38)
    with pytest.raises(RequestRejectedError) as caught:
        processed_scores(torch.tensor([-10.0, -20.0, -30.0, -40.0]),
                         SampleState(0, params, prompt_ids=(0, 1, 3), output_ids=[2]))
    assert caught.value.field == "repetition_penalty"
    raw = torch.tensor([-10.0, -20.0, 30.0, -40.0])
    # token 2 stays finite (30 / 1e38), the others overflow to -inf: probability 0 exactly
    kept = processed_scores(raw, SampleState(0, params, prompt_ids=(0, 1, 2, 3)))
    assert torch.isfinite(kept).tolist() == [False, False, True, False]
    # the model's logits leave only token 2 finite and min_tokens masks it (a stop id)
    raw = torch.tensor([float("-inf"), float("-inf"), 3.0, float("-inf")])
    with pytest.raises(RequestRejectedError) as caught:
        processed_scores(raw, SampleState(0, SamplingParams(min_tokens=1), stop_ids=(2,)))
    assert caught.value.field == "min_tokens"


def test_numpy_scalars_are_taken_as_python_numbers():
    """np.float32(0.5) for top_p was refused as "must be a number in (0, 1]"."""
    got = SamplingParams(top_p=np.float32(0.5), top_k=np.int64(5), temperature=np.float32(0.75),
                         seed=np.int32(3), max_new_tokens=np.int64(4),
                         stop_token_ids=[np.int64(7)], logit_bias={np.int64(9): np.float32(1.5)})
    assert got == SamplingParams(top_p=0.5, top_k=5, temperature=0.75, seed=3, max_new_tokens=4,
                                 stop_token_ids=[7], logit_bias={9: 1.5})
    assert type(got.top_p) is float and type(got.top_k) is int and type(got.seed) is int
    assert type(got.stop_token_ids[0]) is int and type(got.logit_bias[0][0]) is int
    for bad in (dict(top_k=np.float32(5.0)), dict(n=np.bool_(True)), dict(top_k=True),
                dict(top_p=np.float32("nan")), dict(top_p=np.float64(1.5))):
        field = next(iter(bad))
        with pytest.raises(EngineConfigError, match=f"SamplingParams.{field} must be"):
            SamplingParams(**bad)


def test_a_refused_request_alone_in_its_step_fails_alone_and_the_queue_goes_on():
    """max_batch 1: the refused request runs alone in its step. 'Every request's part fails
    alone' used to mean the engine's fault: the step raised, and a server failed every live
    request with a 500. A RequestRejectedError is the request's own: it fails alone."""
    bad = SamplingParams(max_new_tokens=3, ignore_eos=True, repetition_penalty=1e38,
                         logit_bias={t: -100.0 for t in range(VOCAB)})
    plain = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with Engine(model(), max_batch=1, max_context=300) as engine:
        failed, after = engine.generate([list(range(VOCAB)), [5, 6, 7]], [bad, plain])
        alone = engine.generate([[5, 6, 7]], plain)[0]
    assert failed.status == "failed" and failed.error.type == "RequestRejectedError"
    assert after.status == "finished"
    assert after.outputs[0].token_ids == alone.outputs[0].token_ids
