"""Hunt 31 (engineapi): the Engine's request API as a Python user drives it.

- a caller that pops a finished request's output itself (``output(rid, pop=True)`` from an
  ``on_token`` callback of ``generate``, or in a ``stream``'s loop once its event says
  finished) got UnknownRequestError from the batch call after all its work was done; a
  ``generate`` also lost the outputs it had popped before that request's.
"""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from vmemkv.runtime.engine import BeamSearchParams, Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.engine.errors import EngineBusyError  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

KiB = 1024
PAGED = dict(cache="paged", block_size=4, max_batch=4, max_context=64, self_check=False)
VMEM = dict(cache="vmem", page_bytes=4 * KiB, max_batch=4, max_context=64, self_check=False)
BOTH = pytest.mark.parametrize("options", [VMEM, PAGED], ids=["vmem", "paged"])
PROMPTS = [[3] * 8, [4] * 11, [5] * 14]
PARAMS = [SamplingParams(max_new_tokens=3 + i, temperature=0.8, seed=i, ignore_eos=True)
          for i in range(3)]


@functools.lru_cache(maxsize=None)
def model():
    return build_model("tiny-llama", seed=0)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def alone(options):
    """Each request run by itself: the reference every scenario must reproduce."""
    with Engine(model(), **options) as engine:
        return [tokens(engine.generate([p], s))[0] for p, s in zip(PROMPTS, PARAMS)]


def at_baseline(engine) -> None:
    assert engine.kv.manager.stats().live_tokens == 0
    engine.kv.manager.check_integrity()
    engine.kv.check_integrity()


@BOTH
def test_stream_whose_caller_popped_finished_outputs_ends_cleanly(options):
    with Engine(model(), **options) as engine:
        popped = {}
        for event in engine.stream(PROMPTS, PARAMS):
            if event.finished:
                popped[event.request_id] = engine.output(event.request_id, pop=True)
        assert [popped[o.request_id] for o in engine.last_outputs] == engine.last_outputs
        assert tokens(engine.last_outputs) == alone(options)
        assert [o.status for o in engine.last_outputs] == ["finished"] * 3
        at_baseline(engine)


@BOTH
def test_generate_whose_callback_popped_an_output_returns_every_output(options):
    with Engine(model(), **options) as engine:
        popped = []

        def pop_first(event):
            if event.finished and event.request_id == 0:
                popped.append(engine.output(0, pop=True))
        outputs = engine.generate(PROMPTS, PARAMS, on_token=pop_first)
        assert outputs[0] is popped[0]
        assert tokens(outputs) == alone(options)
        assert [o.request_id for o in outputs] == [0, 1, 2]
        assert [o.status for o in outputs] == ["finished"] * 3
        at_baseline(engine)


UNSEEDED = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)


@BOTH
@pytest.mark.parametrize("call", ["generate", "stream", "beam_search"])
def test_batch_call_inside_a_step_is_refused_before_anything_queues(options, call):
    with Engine(model(), seed=7, **options) as untouched:
        expected = untouched.generate([PROMPTS[0], PROMPTS[1]], UNSEEDED)
    with Engine(model(), seed=7, **options) as engine:
        refusals = []

        def batch_inside(event):
            if not refusals:
                try:
                    if call == "generate":
                        engine.generate([[9] * 5], UNSEEDED)
                    elif call == "beam_search":
                        engine.beam_search([[9] * 5], BeamSearchParams(beam_width=2,
                                                                       max_new_tokens=2))
                    else:
                        next(engine.stream([[9] * 5], UNSEEDED))
                except EngineBusyError as error:
                    refusals.append(error)
        first = engine.generate([PROMPTS[0]], UNSEEDED, on_token=batch_inside)[0]
        second = engine.generate([PROMPTS[1]], UNSEEDED)[0]
        assert len(refusals) == 1
        assert [first.request_id, second.request_id] == [0, 1]   # no id was taken
        assert tokens([first, second]) == tokens(expected)       # nor a seed drawn
        assert not engine.has_unfinished()
        at_baseline(engine)


@BOTH
def test_every_event_reaches_on_token_when_a_callback_pops_the_output(options):
    with Engine(model(), **options) as engine:
        seen, collected = [], []

        def collect_when_done(event):
            seen.append((event.index, event.token_id, event.finished))
            if event.finished and not collected and \
                    engine.output(event.request_id).status == "finished":
                collected.append(engine.output(event.request_id, pop=True))
        engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3, n=2, ignore_eos=True),
                           on_token=collect_when_done)
        engine.run_until_done()
        (output,) = collected
        for sample in output.outputs:   # each sample's tokens, its last one flagged finished
            events = [(token, done) for index, token, done in seen if index == sample.index]
            assert events == [(t, i == 2) for i, t in enumerate(sample.token_ids)]
        at_baseline(engine)


def test_last_stats_and_last_outputs_are_none_and_empty_before_any_batch_call():
    """Documented attributes: reading them before the first batch call was an AttributeError."""
    with Engine(model(), **VMEM) as engine:
        assert engine.last_stats is None and tuple(engine.last_outputs) == ()
        engine.generate([PROMPTS[0]], PARAMS[0])
        assert engine.last_stats.output_tokens == 3
