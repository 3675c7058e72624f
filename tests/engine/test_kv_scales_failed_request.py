"""A request that ends "failed" fixes no 8-bit first-write scales: B (a poison token in its
prompt whose layer-0 V is 300x the model's, huge but finite, and whose layer-1 V is NaN: an
overflow in the model, injected by tests/kv_fault_injection.py) batched with plain A fixed layer
0's V scales from B's values (far above A's 0.027 on int8) before layer 1 refused its NaN, and the
failed step's scales were kept by the rollback and by the lone re-runs, so A's tokens and every
later request's differed from a run without B (docs/errors.md 'failed'). Scales that a step
rolled back or a lone run fixed are unfixed: the next kept write fixes them."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

from ..kv_fault_injection import NAN, POISON, VFault, poison_v

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12], [9, 10, 11, 12, 13]]
PLAIN = SamplingParams(max_new_tokens=6, ignore_eos=True)


HUGE_THEN_NAN = (VFault(layer=0, factor=300.0), VFault(layer=1, factor=NAN))   # per V row


@pytest.mark.parametrize("kv_cache_dtype, cache", [("int8", "vmem"), ("fp8_e4m3", "paged")])
def test_a_failed_requests_kv_fixes_no_scales(kv_cache_dtype, cache):
    model = poison_v(build_model("tiny-llama", seed=0), {POISON: HUGE_THEN_NAN})
    options = dict(cache=cache, max_batch=4, max_context=64, kv_cache_dtype=kv_cache_dtype)
    with Engine(model, **options) as reference:       # the plain requests alone, in order
        want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS[1:2], PLAIN)]
        want += [o.outputs[0].token_ids for o in reference.generate(PROMPTS[2:], PLAIN)]
        want_k, want_v = (t.clone() for t in (reference.kv.cache.kv_scales.k,
                                              reference.kv.cache.kv_scales.v))
    with Engine(model, **options) as engine:
        first = engine.generate([PROMPTS[0] + [POISON], PROMPTS[1]], PLAIN)
        later = engine.generate(PROMPTS[2:], PLAIN)
        scales = engine.kv.cache.kv_scales
    assert first[0].status == "failed" and first[0].error.type == "NonFiniteKVError"
    assert "layer 1's V holds NaN" in first[0].error.message
    assert torch.equal(scales.k, want_k) and torch.equal(scales.v, want_v)   # A's, not B's
    assert scales.v[0].max().item() < 0.1 and scales.unsettled == []
    assert [first[1].outputs[0].token_ids, later[0].outputs[0].token_ids] == want


def test_scales_a_recorded_step_fixed_stay_fixed_when_its_commit_is_interrupted(monkeypatch):
    """An interrupt inside a step's commit, past its commit point, leaves the step recorded:
    the 8-bit scales its writes fixed are kept (not unfixed for the next write to fix from other
    values), so the resumed run has the tokens and scales of an uninterrupted one."""
    from vmemkv.runtime.transaction import Phase, StepTransaction

    options = dict(cache="vmem", max_batch=4, max_context=64, kv_cache_dtype="int8")
    with Engine(build_model("tiny-llama", seed=0), **options) as reference:
        want = reference.generate(PROMPTS[:1], PLAIN)[0].outputs[0].token_ids
        want_k, want_v = (t.clone() for t in (reference.kv.cache.kv_scales.k,
                                              reference.kv.cache.kv_scales.v))
    close, interrupted = StepTransaction._close, []

    def interrupted_close(self, keep):
        if self.phase is Phase.RECORDED and not interrupted:   # the first step's commit
            interrupted.append(1)
            raise KeyboardInterrupt
        close(self, keep)

    monkeypatch.setattr(StepTransaction, "_close", interrupted_close)
    with Engine(build_model("tiny-llama", seed=0), **options) as engine:
        rid = engine.add_request(PROMPTS[0], PLAIN)
        with pytest.raises(KeyboardInterrupt):
            engine.run_until_done()
        engine.run_until_done()
        got = engine.output(rid, pop=True).outputs[0].token_ids
        scales = engine.kv.cache.kv_scales
        assert torch.equal(scales.k, want_k) and torch.equal(scales.v, want_v)
    assert got == want
