"""An engine runs its model in eval mode (no dropout) and gives it back in the mode it found:
a model in train mode (a fine-tuning loop that generates between steps) was left in eval mode
for good after ``close()``, after a construction that failed, or after an engine dropped
unclosed, silently switching its dropout off for the training that followed."""
from __future__ import annotations

import gc

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineConfigError

from .conftest import model as built


def _training(name="tiny-llama"):
    m = built(name)
    m.train()
    return m


def test_close_gives_back_train_mode_and_the_engine_ran_in_eval_mode():
    m = _training()
    with Engine(m, max_batch=2, max_context=32) as engine:
        assert not m.training
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert m.training and all(module.training for module in m.modules())


def test_two_engines_give_it_back_when_the_last_closes_and_eval_stays_eval():
    m = _training()
    first = Engine(m, max_batch=2, max_context=32)
    second = Engine(m, max_batch=2, max_context=32)
    first.close()
    assert not m.training              # the second still runs it
    second.close()
    assert m.training
    m.eval()
    Engine(m, max_batch=2, max_context=32).close()
    assert not m.training


def test_a_failed_construction_and_a_dropped_engine_give_it_back(monkeypatch):
    m = _training()
    with monkeypatch.context() as patched:     # fails after the self-check ran it in eval mode
        patched.setattr("vmemkv.runtime.engine.engine.make_kv",
                        lambda *a, **k: (_ for _ in ()).throw(EngineConfigError("no cache")))
        with pytest.raises(EngineConfigError, match="no cache"):
            Engine(m, max_batch=2, max_context=32)
    assert m.training
    Engine(m, max_batch=2, max_context=32)          # dropped unclosed
    gc.collect()
    m(input_ids=__import__("torch").tensor([[1, 2]]))   # the next forward applies the release
    assert m.training
