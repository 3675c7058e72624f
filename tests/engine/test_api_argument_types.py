"""Arguments of the wrong type to the Engine's public calls are refused up front, typed and
naming the argument, with nothing changed; and an ending (abort, close) never fails on a
tokenizer's decode. Before: ``Engine(model, tokenizer="gpt2")`` was built, its first step raised
a raw AttributeError leaving the request running and ``close()`` raised too, the engine left
open; ``add_beam_request(..., on_token=3)`` was queued and raised out of another caller's
``generate``; ``run_until_done(on_step=3)`` ran a step first; ``abort(True)`` aborted request 1,
``status(1.0)`` read it, ``abort([1])`` and ``remove_lora(["a"])`` were raw TypeErrors."""
from __future__ import annotations

import numpy as np
import pytest

from vmemkv.runtime.engine import Engine, EngineConfigError, SamplingParams
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import BeamSearchParamsError
from vmemkv.runtime.hf.attention import ATTN_IMPLEMENTATION

from .byte_tokenizer import byte_tokenizer
from .conftest import model

OPTIONS = dict(max_batch=8, max_context=64)
LONG = SamplingParams(max_new_tokens=20, ignore_eos=True)


class BreakableTokenizer:
    """The byte tokenizer, whose ``decode`` raises once ``broken`` is set."""

    def __init__(self) -> None:
        self.inner, self.broken = byte_tokenizer(), False

    def __call__(self, text, **kwargs):
        return self.inner(text, **kwargs)

    def decode(self, ids, **kwargs) -> str:
        if self.broken:
            raise RuntimeError("decode is broken")
        return self.inner.decode(ids, **kwargs)


class DecodeOnly:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


@pytest.mark.parametrize("tokenizer, lacking", [
    ("gpt2", ["encodes text", "decode(", "AutoTokenizer.from_pretrained('gpt2')"]),
    (3, ["encodes text", "decode("]),
    (DecodeOnly(), ["encodes text"]),
    (lambda text: {"input_ids": [1]}, ["decode("])])
def test_a_tokenizer_that_is_not_one_is_refused_naming_it_before_anything_is_built(tokenizer,
                                                                                    lacking):
    lm = model()
    before = lm.config._attn_implementation
    with pytest.raises(EngineConfigError) as info:
        Engine(lm, tokenizer, **OPTIONS)
    message = str(info.value)
    assert message.startswith("tokenizer must be None or a tokenizer")
    assert all(word in message for word in lacking), message
    assert lm.config._attn_implementation == before     # no engine took the model


def test_close_releases_everything_though_the_tokenizer_raises_in_decode():
    tokenizer, lm = BreakableTokenizer(), model()
    before = lm.config._attn_implementation
    engine = Engine(lm, tokenizer, **OPTIONS)
    sample = engine.add_request("abc", LONG)
    beam = engine.add_beam_request([5, 6, 7], BeamSearchParams(2, max_new_tokens=20,
                                                               ignore_eos=True))
    shown = "".join(event.text for _ in range(3) for event in engine.step()
                    if event.request_id == sample)         # the text its events showed
    assert shown
    assert len(engine.output(sample).outputs[0].token_ids) == 3
    assert lm.config._attn_implementation == ATTN_IMPLEMENTATION
    tokenizer.broken = True
    engine.close()                                       # it raised, and the engine stayed open
    assert engine.closed and not engine.has_unfinished()
    assert lm.config._attn_implementation == before      # released: the model is its own again
    out = engine.output(sample)
    assert out.status == "aborted" and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == shown   # as it was
    beams = engine.output(beam)
    assert beams.status == "aborted" and len(beams.outputs) == 2
    assert all(c.text is None and len(c.token_ids) == 3 for c in beams.outputs)
    engine.close()                                       # idempotent


def test_abort_ends_a_request_though_the_tokenizer_raises_and_the_other_goes_on():
    tokenizer = BreakableTokenizer()
    with Engine(model(), tokenizer, **OPTIONS) as engine:
        doomed, other = engine.add_request("ab", LONG), engine.add_request("cd", LONG)
        engine.step()
        engine.step()
        tokenizer.broken = True
        out = engine.abort(doomed)                       # it raised, leaving the request live
        assert out.status == engine.status(doomed) == "aborted"
        assert len(out.outputs[0].token_ids) == 2
        tokenizer.broken = False
        engine.run_until_done()
        assert engine.status(other) == "finished"
        assert len(engine.output(other).outputs[0].token_ids) == 20


def test_add_beam_request_refuses_what_is_not_a_callback_or_params_and_queues_nothing():
    with Engine(model(), cache="paged", **OPTIONS) as engine:
        with pytest.raises(EngineConfigError, match="on_token must be callable or None, got 3"):
            engine.add_beam_request([1, 2], BeamSearchParams(2, max_new_tokens=3), on_token=3)
        for call in (lambda: engine.add_beam_request([1, 2], "x"),
                     lambda: engine.check_beam_params("x")):
            with pytest.raises(BeamSearchParamsError, match="params must be a BeamSearchParams, "
                                                            "got str 'x'") as info:
                call()
            assert info.value.field == "params"
        assert not engine.has_unfinished()
        # another caller's generate is not touched (it raised the callback's TypeError)
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert out[0].request_id == 0 and len(out[0].outputs[0].token_ids) == 3


def test_run_until_done_refuses_an_on_step_that_is_not_callable_before_any_step():
    with Engine(model(), **OPTIONS) as engine:
        rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        with pytest.raises(EngineConfigError, match="on_step must be callable or None, got 3"):
            engine.run_until_done(on_step=3)
        assert engine.status(rid) == "waiting" and engine.output(rid).outputs[0].token_ids == []
        steps = []
        engine.run_until_done(on_step=steps.append)
        assert len(steps) == 4 and len(engine.output(rid).outputs[0].token_ids) == 4


@pytest.mark.parametrize("bad", [True, 1.0, np.int64(1), [1], {}, "1", None],
                         ids=["bool", "float", "numpy-int", "list", "dict", "str", "None"])
def test_a_request_id_that_is_not_an_int_is_refused_naming_request_id_and_changes_nothing(bad):
    with Engine(model(), **OPTIONS) as engine:
        first = engine.add_request([1, 2, 3], LONG)
        second = engine.add_request([4, 5, 6], LONG)
        assert (first, second) == (0, 1)
        for call in (engine.abort, engine.status, engine.output,
                     lambda rid: engine.output(rid, pop=True)):
            with pytest.raises(EngineConfigError, match="request_id must be an int .* got "
                                                        f"{type(bad).__name__} "):
                call(bad)
        assert engine.status(first) == engine.status(second) == "waiting"   # True aborted 1
        assert engine.output(1).request_id == 1


def test_remove_lora_refuses_a_name_that_is_not_a_str_and_changes_nothing():
    with Engine(model(), **OPTIONS) as engine:
        for bad in (["a"], {}, 3):
            with pytest.raises(EngineConfigError, match="remove_lora: name must be a str, got "
                                                        f"{type(bad).__name__} "):
                engine.remove_lora(bad)
        with pytest.raises(EngineConfigError, match="no adapter named 'a'"):
            engine.remove_lora("a")
        assert engine.loras == []
