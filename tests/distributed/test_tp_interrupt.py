"""A Ctrl-C during a tensor-parallel step (gloo, 2 ranks on the CPU). Cut inside rank 0's
forward, it left rank 1 in the layer's all_reduce: the next step's plan broadcast met it, and
after ``tp_timeout_s`` the engine closed with every request lost, though docs/usage.md says
``run_until_done`` resumes after a Ctrl-C with exactly the tokens of an uninterrupted run. The
interrupt now lands after the step, on the main thread (``runtime/interrupts.py``)."""
from __future__ import annotations

import signal

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.models import build_model

PROMPTS = [list(range(1, 40)), list(range(3, 30))]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
OPTIONS = dict(max_batch=4, max_context=128, tp_timeout_s=20, self_check=False)


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler, as a program has it (a test before may have set another)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_a_tensor_parallel_step_lands_after_it_and_the_run_resumes(
        python_sigint_handler):
    model = build_model("tiny-llama", seed=0)
    with Engine(model, **OPTIONS) as alone:
        want = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, PARAMS)]
    with Engine(model, tensor_parallel_size=2, **OPTIONS) as engine:
        ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
        forward, steps = engine.tp.executor.forward, []

        def interrupted(plan):       # SIGINT between the plan broadcast and the layers' sums
            steps.append(1)
            if len(steps) == 4:
                signal.raise_signal(signal.SIGINT)
            return forward(plan)
        engine.tp.executor.forward = interrupted
        with pytest.raises(KeyboardInterrupt):
            engine.run_until_done()
        assert len(steps) == 4          # the step it struck ran to its end on every rank
        engine.run_until_done()
        assert [engine.output(i).outputs[0].token_ids for i in ids] == want
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
