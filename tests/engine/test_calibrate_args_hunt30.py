"""calibrate() called from Python (benchmarks/calibration_stability.py does) with a value the
CLI's flags bound: refused by name before the model is built (hunt 30). It timed every shape,
then failed (a batch of 0: IndexError; a join batch of 0: KeyError; 0 resamples: IndexError),
or timed something other than asked (a join of 0 tokens: no join; 1.5 repeats: 2)."""
import pytest

from vmemkv.runtime import models
from vmemkv.runtime.calibrate import calibrate
from vmemkv.runtime.engine.errors import EngineConfigError

SMALL = dict(batches=(1,), contexts=(8,), decode_steps=7, repeats=1, max_repeats=1,
             max_context=32, prefill_lengths=())


@pytest.mark.parametrize("changes,message", [
    (dict(batches=(1, 0)), "calibrate batches must be a list of ints >= 1, not empty, got (1, 0)"),
    (dict(batches=()), "calibrate batches must be a list of ints >= 1, not empty, got ()"),
    (dict(join_lengths=(4,), join_batches=(0,)),
     "calibrate join_batches must be a list of ints >= 1, got (0,)"),
    (dict(join_lengths=(0,)), "calibrate join_lengths must be a list of ints >= 1, got (0,)"),
    (dict(repeats=6, max_repeats=6, resamples=0), "calibrate resamples must be an int >= 10, got 0"),
    (dict(repeats=1.5, max_repeats=2), "calibrate repeats must be an int >= 1, got 1.5"),
    (dict(contexts=[8, True]), "calibrate contexts must be a list of ints >= 1, not empty, "
                               "got [8, True]"),
])
def test_a_value_the_cli_bounds_is_refused_by_name_before_the_model_is_built(
        monkeypatch, changes, message):
    def no_build(*args, **kwargs):
        raise AssertionError("the model was built: the timing would have started")

    monkeypatch.setattr(models, "build_model", no_build)
    with pytest.raises(EngineConfigError) as error:
        calibrate("tiny-llama", **{**SMALL, **changes})
    assert str(error.value) == message
