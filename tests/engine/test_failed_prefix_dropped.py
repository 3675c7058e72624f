"""A request that failed because its K/V went bad (a NaN an earlier prefill chunk wrote, seen
only when its logits were sampled) leaves nothing findable in the prefix cache: before, its
published units stayed cached and every later request with the same prompt was served them
and failed too (a shared system prompt: every tenant), until eviction. Now the failed request
is unpublished as it ends (``MemoryManager.unpublish``), the next request with that prompt
computes it again, exact, and publishes it for the ones after."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import model

PROMPT = list(range(10, 58))          # 48 tokens: three 16-token prefill chunks
PLAIN = SamplingParams(max_new_tokens=4, ignore_eos=True)
OPTIONS = {"paged": dict(cache="paged", block_size=16), "vmem": dict(cache="vmem", page_bytes=4096)}


def nan_once_on(token: int):
    """A forward hook on the embedding: the first forward that embeds ``token`` gets NaN
    there (a transient overflow), every later one is exact."""
    left = [1]

    def hook(module, args, out):
        ids = args[0]
        if left[0] and (ids == token).any():
            left[0] -= 1
            out = out.clone()
            out[ids == token] = float("nan")
        return out
    return hook


@pytest.mark.parametrize("cache", ["paged", "vmem"])
def test_a_failed_requests_prefix_is_not_served_to_later_requests(cache):
    options = dict(max_batch=2, max_context=128, prefix_sharing=True, max_tokens_per_step=16,
                   self_check=False, **OPTIONS[cache])
    m = model("tiny-llama")
    with Engine(m, **options) as fresh:
        want = fresh.generate([PROMPT], PLAIN)[0].outputs[0].token_ids
    hook = m.model.embed_tokens.register_forward_hook(nan_once_on(PROMPT[0]))
    try:
        with Engine(m, **options) as engine:
            other = engine.add_request([200, 201, 202],
                                       SamplingParams(max_new_tokens=12, ignore_eos=True))
            engine.step()                                   # decoding when the failing one comes
            failing = engine.add_request(PROMPT, PLAIN)
            engine.run_until_done()
            failed = engine.output(failing)
            hits_before = engine.kv.manager.prefix_hits
            again = engine.generate([PROMPT], PLAIN)[0]     # the model is healthy again
            hits_again = engine.kv.manager.prefix_hits - hits_before
            after = engine.generate([PROMPT], PLAIN)[0]
            hits_after = engine.kv.manager.prefix_hits - hits_before - hits_again
            assert engine.output(other).status == "finished"
    finally:
        hook.remove()
    assert failed.status == "failed" and failed.error.type == "NonFiniteLogitsError"
    assert again.status == "finished" and again.outputs[0].token_ids == want
    assert hits_again == 0                  # nothing of the failed request was found
    assert hits_after == 32                 # the healthy one's prefix is: two whole 16-token units
    assert after.outputs[0].token_ids == want
