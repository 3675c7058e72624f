"""vLLM's ``stop_reason`` on every sample that ended "stop": the stop string that ended its text
(of several, the one found), the ``stop_token_ids`` id that ended it, None for an EOS token and
for any other ending (length, abort). The last TokenEvent carries it too; a beam search that
ended on a stop id names it."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import BeamSearchParams, Engine, SamplingParams
from vmemkv.runtime.models import eos_token_ids

from .byte_tokenizer import byte_tokenizer
from .conftest import model

X, Y = ord("x"), ord("y")
PROMPT = [5, 17, 101, 33]
ENGINE = dict(cache="vmem", max_batch=4, max_context=64)


def ended(engine, params: SamplingParams):
    events = []
    rid = engine.add_request(PROMPT, params, on_token=events.append)
    engine.run_until_done()
    sample = engine.output(rid, pop=True).outputs[0]
    assert events[-1].finished and events[-1].stop_reason == sample.stop_reason
    assert all(e.stop_reason is None for e in events[:-1])
    return sample


@pytest.fixture(scope="module")
def engine():
    with Engine(model(), byte_tokenizer(), **ENGINE) as built:
        yield built


def test_a_stop_string_is_the_stop_reason(engine):
    sample = ended(engine, SamplingParams(max_new_tokens=8, logit_bias={X: 100.0},
                                          stop=["zz", "xx"], ignore_eos=True))
    assert (sample.finish_reason, sample.stop_reason, sample.text) == ("stop", "xx", "")
    kept = ended(engine, SamplingParams(max_new_tokens=8, logit_bias={X: 100.0}, stop=["xxx"],
                                        include_stop_str_in_output=True, ignore_eos=True))
    assert (kept.stop_reason, kept.text) == ("xxx", "xxx")


def test_a_stop_token_id_is_the_stop_reason_and_eos_and_length_are_none(engine):
    by_id = ended(engine, SamplingParams(max_new_tokens=8, logit_bias={Y: 100.0},
                                         stop_token_ids=[Y], ignore_eos=True))
    assert (by_id.finish_reason, by_id.stop_reason, by_id.token_ids) == ("stop", Y, [Y])
    eos = eos_token_ids(model())[0]
    by_eos = ended(engine, SamplingParams(max_new_tokens=8, logit_bias={eos: 100.0}))
    assert (by_eos.finish_reason, by_eos.stop_reason, by_eos.token_ids) == ("stop", None, [eos])
    cut = ended(engine, SamplingParams(max_new_tokens=3, logit_bias={X: 100.0}, stop=["xxxx"],
                                       ignore_eos=True))
    assert (cut.finish_reason, cut.stop_reason) == ("length", None)


def test_a_beam_that_ends_on_a_stop_id_names_it(engine):
    stop = 29    # this model's second beam hypothesis reaches it on this prompt
    out = engine.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_new_tokens=6,
                                                        stop_token_ids=(stop,), ignore_eos=True))[0]
    assert [(c.finish_reason, c.stop_reason) for c in out.outputs] == [("stop", stop),
                                                                        ("length", None)]
