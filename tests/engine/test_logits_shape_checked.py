"""The model's logits are checked right after its forward: floating point, of shape (1, rows
kept, vocab_size), else LogitsShapeError naming both shapes, handled as a forward that raised.
Before, nothing was checked: narrower logits picked other tokens silently, wider ones emitted
ids past the vocabulary (then an IndexError in the embedding, the engine stuck), and too few
rows failed innocent requests with an IndexError."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import LogitsShapeError

from .conftest import VOCAB, model

BAD = 99                                   # the token whose batch gets bad logits
PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [BAD, 5, 6], [9, 9, 2, 6]]
PLAIN = SamplingParams(max_new_tokens=4, ignore_eos=True)
BREAK = {"narrow": lambda logits: logits[..., :10],
         "wide": lambda logits: torch.cat([logits, logits[..., :40] + 100], -1),
         "integer": lambda logits: logits.long(),
         "few rows": lambda logits: logits[:, :1]}


def breaking(how: str, when=lambda ids: True):
    """A forward hook giving the model's logits ``BREAK[how]`` on forwards ``when`` accepts
    (their input ids); ``hook.on = False`` makes it exact again."""
    def hook(module, args, kwargs, out):
        if hook.on and when(kwargs["input_ids"]):
            out.logits = BREAK[how](out.logits)
        return out
    hook.on = True
    return hook


def run(hook, prompts):
    m = model("tiny-llama")
    handle = m.register_forward_hook(hook, with_kwargs=True)
    try:
        with Engine(m, max_batch=4, max_context=64, self_check=False) as engine:
            return engine.generate(prompts, PLAIN)
    finally:
        handle.remove()


@pytest.mark.parametrize("how", ["narrow", "wide", "integer"])
def test_bad_logits_of_one_requests_batch_fail_it_alone_naming_the_shapes(how):
    good = [p for p in PROMPTS if BAD not in p]
    want = [o.outputs[0].token_ids for o in run(breaking(how, lambda ids: False), good)]
    outs = run(breaking(how, lambda ids: bool((ids == BAD).any())), PROMPTS)
    failed = outs[PROMPTS.index([BAD, 5, 6])]
    assert failed.status == "failed" and failed.error.type == "LogitsShapeError"
    assert f"shape (1, 1, {VOCAB})" in failed.error.message   # expected, then what came back
    got = {"narrow": "(1, 1, 10) torch.float32", "wide": f"(1, 1, {VOCAB + 40}) torch.float32",
           "integer": f"(1, 1, {VOCAB}) torch.int64"}[how]
    assert f"returned logits {got}" in failed.error.message
    assert [o.outputs[0].token_ids for o in outs if o is not failed] == want
    assert all(o.status == "finished" for o in outs if o is not failed)


@pytest.mark.parametrize("how", ["few rows", "wide"])
def test_bad_logits_of_every_sequence_reach_the_caller_and_fail_nobody(how):
    hook = breaking(how)
    m = model("tiny-llama")
    handle = m.register_forward_hook(hook, with_kwargs=True)
    try:
        with Engine(m, max_batch=4, max_context=64, self_check=False) as engine:
            ids = [engine.add_request(p, PLAIN) for p in PROMPTS]
            with pytest.raises(LogitsShapeError, match=rf"shape \(1, 4, {VOCAB}\)"):
                engine.step()
            assert [engine.output(r).outputs[0].token_ids for r in ids] == [[]] * 4
            assert {engine.status(r) for r in ids} <= {"waiting", "running"}   # none failed
            hook.on = False                                        # the model is fine again
            engine.run_until_done()
            got = [engine.output(r).outputs[0].token_ids for r in ids]
    finally:
        handle.remove()
    assert got == [o.outputs[0].token_ids for o in run(breaking(how, lambda ids: False), PROMPTS)]
