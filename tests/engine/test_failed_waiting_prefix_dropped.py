"""A request preempted for recompute published what it had computed when it was freed; if it
then fails while WAITING (it can no longer be admitted: RequestTooLargeError naming it) the
manager holds no record of it, so ``unpublish`` did nothing and its units stayed findable: the
NaN an earlier prefill chunk wrote was served to the next request with that prompt, whose
logits were NaN (NonFiniteLogitsError). Now the failed ending drops the units its tokens reach
under its scope (``MemoryManager.unpublish_tokens``, runtime/engine/ending.py): the next
request computes the prompt again, exact. The manager-level half checks every layout (paged
and vmem, hybrids, block-level entries) and that a namespace bounds what is dropped."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.scheduler.errors import RequestTooLargeError
from vmemkv.scheduler.request import SeqState

from ..scheduler.test_unpublish_failed import LAYOUTS, PROMPT as UNIT_PROMPT, hit, manager
from .conftest import model
from .test_failed_prefix_dropped import nan_once_on

PROMPT = list(range(10, 58))          # 48 tokens: 15-token chunks beside a decode
PLAIN = SamplingParams(max_new_tokens=4, ignore_eos=True)
# (options, cache bytes, steps the other request runs alone): at 512 bytes a token, the other's
# growth preempts the failing one after two chunks (30 tokens computed: one 16-token unit
# published, the NaN at its first token) and before its last chunk samples
CASES = {"paged": (dict(cache="paged", block_size=16), 5 * 16 * 512, 16),
         "vmem": (dict(cache="vmem", page_bytes=4096), 4 * 32 * 512, 48)}


def fail_next_step_naming(engine, request_id: int) -> None:
    """The next step's planning finds ``request_id`` can never be admitted (as the scheduler's
    never-fits check says of a waiting head the pool cannot hold)."""
    scheduler, schedule = engine.scheduler, engine.scheduler.schedule

    def never_fits():
        scheduler.schedule = schedule
        raise RequestTooLargeError(f"request {request_id} cannot be admitted to an empty cache",
                                   request_id=request_id)
    scheduler.schedule = never_fits


@pytest.mark.parametrize("cache", ["paged", "vmem"])
def test_a_request_failed_while_waiting_after_recompute_leaves_nothing_findable(cache):
    options, cache_bytes, alone_steps = CASES[cache]
    options = dict(max_batch=2, max_context=96, prefix_sharing=True, max_tokens_per_step=16,
                   self_check=False, **options)
    m = model("tiny-llama")
    with Engine(m, **options) as fresh:
        want = fresh.generate([PROMPT], PLAIN)[0].outputs[0].token_ids
    hook = m.model.embed_tokens.register_forward_hook(nan_once_on(PROMPT[0]))
    try:
        with Engine(m, cache_bytes=cache_bytes, **options) as engine:
            other = engine.add_request(list(range(200, 215)),
                                       SamplingParams(max_new_tokens=60, ignore_eos=True))
            for _ in range(alone_steps):
                engine.step()
            failing = engine.add_request(PROMPT, PLAIN)
            seq = next(q for q in engine.scheduler.seqs.values()
                       if q.request.request_id == failing)
            for _ in range(3):
                engine.step()
            assert seq.state is SeqState.WAITING and engine.scheduler.metrics.num_preemptions == 1
            assert engine.kv.manager.cached_tokens >= 16      # its first unit, NaN inside
            fail_next_step_naming(engine, failing)
            engine.step()
            failed = engine.output(failing)
            engine.abort(other)                   # room for the next one at once
            hits_before = engine.kv.manager.prefix_hits
            again = engine.add_request(PROMPT, PLAIN)
            engine.run_until_done()
            hits_again = engine.kv.manager.prefix_hits - hits_before
            again = engine.output(again)
    finally:
        hook.remove()
    assert failed.status == "failed" and failed.error.type == "RequestTooLargeError"
    assert hits_again == 0                  # nothing of the failed request was found
    assert again.status == "finished" and again.outputs[0].token_ids == want


@pytest.mark.parametrize("policy, kind", LAYOUTS)
def test_the_units_a_forgotten_sequences_tokens_reach_are_found_no_more(policy, kind):
    m = manager(policy, kind)
    hit(m, 0)
    m.free(0)                               # preempted for recompute: published, then forgotten
    cached = m.cached_tokens
    assert cached > 0
    m.unpublish_tokens(UNIT_PROMPT, "other tenant")   # another scope reaches nothing of it
    assert m.cached_tokens == cached
    m.begin()
    m.unpublish_tokens(UNIT_PROMPT, None)
    m.rollback()                            # undone whole inside a transaction
    assert m.cached_tokens == cached
    m.unpublish_tokens(UNIT_PROMPT, None)
    m.check_integrity()
    assert m.cached_tokens == 0             # nobody held them: back to the pool
    assert hit(m, 1) == 0                   # nothing of it is found
    m.free(1)
    assert hit(m, 2) == 12                  # the one that computed it again published it
    m.check_integrity()
