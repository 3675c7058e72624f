"""A request whose forward returns logits of the wrong shape under tensor parallelism (gloo, 2
ranks on the CPU) ends "failed" alone, as on one process; every rank stays alive and in step.

``LogitsShapeError`` is raised after the model returns, so every rank has finished the
forward's collectives and checks the same logits: rank 0 took it for a forward failing inside
them, closed the engine (TensorParallelError) and failed every request in flight, and rank 1's
process exited. The faulty model's hook travels with the pickled model to every rank."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

BAD_TOKEN = 99
PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [BAD_TOKEN, 5, 6], [9, 9, 2, 6]]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
OPTIONS = dict(cache="vmem", max_batch=4, max_context=64)


def narrow_logits_on_the_bad_token(module, args, kwargs, out):
    """A model bug one request's tokens trigger: ten logits a row instead of the vocabulary's."""
    input_ids = kwargs.get("input_ids")
    if input_ids is not None and (input_ids == BAD_TOKEN).any():
        out.logits = out.logits[..., :10]
    return out


def test_bad_logits_under_tp_fail_their_request_alone_and_keep_every_rank_in_step():
    model = build_model("tiny-llama", seed=0)
    with Engine(model, **OPTIONS) as reference:
        want = [o.outputs[0].token_ids for o in
                reference.generate([p for p in PROMPTS if BAD_TOKEN not in p], PARAMS)]
    model.register_forward_hook(narrow_logits_on_the_bad_token, with_kwargs=True)
    with Engine(model, tensor_parallel_size=2, tp_timeout_s=60, self_check=False,
                **OPTIONS) as engine:
        pids = engine.tp.rank_pids
        outs = engine.generate(PROMPTS, PARAMS)
        bad = outs[2]
        assert bad.status == "failed" and bad.error.type == "LogitsShapeError"
        assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == want
        assert all(o.status == "finished" for i, o in enumerate(outs) if i != 2)
        states = engine.tp.memory_states()             # both ranks answer: alive, in step
        assert engine.tp.rank_pids == pids and not engine.closed
        engine.kv.check_integrity()
        assert engine.kv.manager.stats().live_tokens == 0 and not engine.has_unfinished()
        assert states[1]["placements"] == states[0]["placements"]
        assert states[1]["mapped_extents"] == states[0]["mapped_extents"]
        again = engine.generate([PROMPTS[0]], PARAMS)[0]     # the engine goes on serving
        assert again.status == "finished" and again.outputs[0].token_ids == want[0]
