"""A beam search that finishes alone finishes beside other requests under recompute preemption,
with the same beams. A child forked into no room (3 beams of a 16-token prompt, 8-token blocks,
6 blocks) joined its running siblings later holding its own copy of the prompt (3 blocks), so
the group (2 shared + 2 own + 3 = 7 blocks at 17 tokens) could not grow with the cache to
itself and failed 'cannot grow in a cache of 48 tokens'; it now holds the prompt's units of the
sibling it shares them with (``_place_private``, ``_sibling_share``): 5 blocks."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.beam_params import BeamSearchParams

from .conftest import model

OPTIONS = dict(cache="paged", block_size=8, max_batch=4, max_tokens_per_step=16,
               cache_bytes=24576, max_context=128, preemption="recompute",
               check_integrity=False)
BEAM = ([67, 176, 185, 211, 74, 50, 89, 184, 96, 245, 131, 77, 84, 141, 84, 190],
        BeamSearchParams(3, max_new_tokens=6, ignore_eos=True))
OTHERS = [(list(range(1, 22)), SamplingParams(max_new_tokens=11, ignore_eos=True)),
          ([199, 101, 143, 157, 120, 103, 168],
           BeamSearchParams(2, max_new_tokens=8, ignore_eos=True, cache_salt="b")),
          ([91], SamplingParams(max_new_tokens=7, ignore_eos=True))]


def add(engine, prompt, params):
    if isinstance(params, BeamSearchParams):
        return engine.add_beam_request(prompt, params)
    return engine.add_request(prompt, params)


def run(batch):
    with Engine(model("tiny-llama"), **OPTIONS) as engine:
        ids = [add(engine, *r) for r in batch]
        engine.run_until_done()
        outs = [engine.output(i) for i in ids]
        assert engine.kv.manager.stats().live_tokens == 0
        return outs, engine.scheduler.metrics


def test_a_beam_search_beside_others_finishes_with_the_beams_it_has_alone():
    (alone,), _ = run([BEAM])
    assert alone.status == "finished"
    outs, metrics = run(OTHERS + [BEAM])
    assert [o.status for o in outs] == ["finished"] * 4     # the search had failed
    assert outs[-1].error is None and metrics.num_preemptions > 0
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in alone.outputs]
    assert [len(c.token_ids) for c in outs[-1].outputs] == [6, 6, 6]
