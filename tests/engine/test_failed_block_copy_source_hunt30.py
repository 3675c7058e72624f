"""A request that failed after a vmem block hit leaves nothing it hit findable, the group it
copied its blocks from included (docs/usage.md: "every unit it published or hit leaves the
index"). The copy source is no unit of the failed sequence, so the resident unpublish missed
it: a prefix shorter than a page (chained on the namespace root, not on a registration the
failed sequence held) stayed findable, and when the failure came from that prefix's K/V (a NaN
an aborted request's first prefill chunk wrote), every later request copying it failed too,
where paged recomputed it and finished."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import model
from .test_failed_prefix_dropped import nan_once_on

SYSTEM = list(range(10, 50))        # 40 tokens; its first 20 are under one 32-token page
PLAIN = SamplingParams(max_new_tokens=4, ignore_eos=True)
OPTIONS = {"paged": dict(cache="paged", block_size=4),
           "vmem": dict(cache="vmem", page_bytes=4096, block_size=4)}   # 32-token pages


def finish(engine, prompt):
    """Run ``prompt`` beside the engine's running request; its output and prefix-hit tokens."""
    hits_before = engine.kv.manager.prefix_hits
    rid = engine.add_request(prompt, PLAIN)
    while engine.status(rid) not in ("finished", "failed", "aborted"):
        engine.step()
    return engine.output(rid), engine.kv.manager.prefix_hits - hits_before


@pytest.mark.parametrize("cache", ["paged", "vmem"])
def test_a_block_hit_that_failed_its_request_is_not_served_again(cache):
    options = dict(max_batch=3, max_context=128, prefix_sharing=True, max_tokens_per_step=16,
                   self_check=False, **OPTIONS[cache])
    m = model("tiny-llama")
    prompt = SYSTEM[:20] + [60, 61]
    with Engine(m, **options) as fresh:
        want = fresh.generate([prompt], PLAIN)[0].outputs[0].token_ids
    hook = m.model.embed_tokens.register_forward_hook(nan_once_on(SYSTEM[2]))
    try:
        with Engine(m, check_integrity=True, **options) as engine:
            engine.add_request([200, 201, 202], SamplingParams(max_new_tokens=40, ignore_eos=True))
            engine.step()                                    # decoding beside the others
            poisoned = engine.add_request(SYSTEM, PLAIN)
            engine.step()                                    # its first chunk: NaN K/V, published
            engine.abort(poisoned)                           # ...and never sampled
            first, first_hits = finish(engine, SYSTEM[:20] + [50, 51])
            second, second_hits = finish(engine, prompt)
            third, third_hits = finish(engine, prompt)
    finally:
        hook.remove()
    assert first.status == "failed" and first_hits == 12    # it read the poisoned prefix
    assert second.status == "finished" and second_hits == 0  # nothing it hit was found
    assert second.outputs[0].token_ids == want
    assert third.status == "finished" and third_hits == 20   # the healthy prefix is
    assert third.outputs[0].token_ids == want
