"""The engine's counters count what they say: ``EngineStats.requests`` and ``prompt_tokens`` one
population (the requests that finished: a failed or aborted request's prompt was counted beside
a request count that left it out), a forked sample that found no room in ``recomputed_tokens``
(it computes again the prompt it would have shared, and was counted nowhere), and /metrics'
``num_failed_requests`` HELP names every failure it counts."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import BeamSearchParams, Engine, SamplingParams
from vmemkv.runtime.serve.metrics import ServeMetrics

from .conftest import VOCAB, model

PLAIN = SamplingParams(max_new_tokens=3, ignore_eos=True)
# every processed score -inf: the request fails alone, in its step, for its own parameters
REFUSED = SamplingParams(max_new_tokens=3, ignore_eos=True, repetition_penalty=1e38,
                         logit_bias={t: -100.0 for t in range(VOCAB)})


def test_a_failed_requests_prompt_is_not_counted_beside_the_finished_requests():
    with Engine(model(), max_batch=2, max_context=300) as engine:
        failed, done = engine.generate([list(range(VOCAB)), [5, 6, 7]], [REFUSED, PLAIN])
        stats = engine.last_stats
    assert (failed.status, done.status) == ("failed", "finished")
    assert (stats.requests, stats.prompt_tokens) == (1, 3)          # was (1, 259)
    assert stats.prompt_tokens == stats.serving["total_input_tokens"]
    assert stats.output_tokens == 3                                  # the failed one sampled none


def test_an_aborted_requests_prompt_is_not_counted_beside_the_finished_requests():
    with Engine(model(), max_batch=4, max_context=64) as engine:
        kept = engine.add_request([1, 2, 3, 4, 5], PLAIN)
        aborted = engine.add_request([6, 7, 8, 9, 10, 11, 12], PLAIN)
        engine.step()
        engine.abort(aborted)
        engine.run_until_done()
        stats = engine.stats()
        assert engine.output(kept).status == "finished"
    assert (stats.requests, stats.prompt_tokens) == (1, 5)          # was (1, 12)


def test_a_step_undone_after_it_finished_a_request_takes_its_prompt_back(monkeypatch):
    """The step fails after recording its tokens (the last thing it records: the usage): it
    is undone whole, and the request finishes once, in the step that runs again."""
    with Engine(model(), max_batch=2, max_context=64) as engine:
        engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=1, ignore_eos=True))
        usage, calls = engine.kv.manager.kv_cache_usage, []

        def fails_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected after the step's recording")
            return usage()

        monkeypatch.setattr(engine.kv.manager, "kv_cache_usage", fails_once)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        assert (engine.stats().requests, engine.stats().prompt_tokens) == (0, 0)
        engine.run_until_done()
        stats = engine.stats()
    assert len(calls) == 2 and (stats.requests, stats.prompt_tokens) == (1, 4)


def test_a_request_of_n_samples_or_beams_counts_its_prompt_once():
    prompt = list(range(10, 30))
    with Engine(model(), max_batch=4, max_context=64) as engine:
        engine.generate([prompt], SamplingParams(n=3, max_new_tokens=3, temperature=1.0,
                                                 seed=1, ignore_eos=True))
        sampled = engine.last_stats
        engine.beam_search([prompt], BeamSearchParams(2, max_new_tokens=3, ignore_eos=True))
        beams = engine.last_stats
    assert (sampled.requests, sampled.prompt_tokens) == (beams.requests, beams.prompt_tokens) \
        == (1, 20)


@pytest.mark.parametrize("cache", ["paged", "vmem"])
def test_a_forked_sample_that_found_no_room_counts_its_prompt_as_recomputed(cache):
    """max_batch 1: the second sample of n=2 does not fit beside the first at the fork, waits,
    and computes the 20-token prompt it would have shared once the first is done."""
    with Engine(model(), cache=cache, max_batch=1, max_context=64) as engine:
        (out,) = engine.generate([list(range(20))], SamplingParams(
            n=2, max_new_tokens=3, temperature=1.0, seed=1, ignore_eos=True))
        stats = engine.last_stats
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
    assert stats.num_preemptions == 0
    assert stats.recomputed_tokens == 20                             # was 0
    # the first sample: prompt + 2 decodes; the second: the prompt again + its first token + 1
    assert stats.computed_tokens == (20 + 2) + (20 + 1 + 1)


def test_a_forked_sample_done_at_the_fork_recomputes_nothing():
    """With one output token the second sample is done when it is forked: it never waits."""
    with Engine(model(), max_batch=1, max_context=64) as engine:
        (out,) = engine.generate([list(range(20))], SamplingParams(
            n=2, max_new_tokens=1, temperature=1.0, seed=1, ignore_eos=True))
        stats = engine.last_stats
    assert [len(c.token_ids) for c in out.outputs] == [1, 1]
    assert (stats.recomputed_tokens, stats.computed_tokens) == (0, 20)


def test_the_failed_requests_help_names_every_failure_it_counts():
    (line,) = [line for line in ServeMetrics("m").render().splitlines()
               if line.startswith("# HELP vmemkv:num_failed_requests_total ")]
    assert line.split(" ", 3)[3] == (
        "Requests that ended failed: failed alone by the engine, for their own parameters "
        "(a 400 naming the field: every score -inf after penalties and logit_bias, or a "
        "request the KV cache can never hold) or because their memory plans, forward or "
        "sampling kept failing (a 500), or with every live request when a step raised "
        "that no request could be blamed for (a 500).")
