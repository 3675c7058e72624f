"""SampleLog: the latency samples a scheduler and an engine keep, bounded.

Before it, ``SchedulerMetrics.ttft_s``/``itl_s`` and the engine's per-step K/V usage were lists
that grew by 32 bytes per token and per step for the engine's whole life (a server making 5,000
tokens a second would have grown by about 13 GB a day). A SampleLog keeps the latest
``keep``..``2 * keep`` samples as doubles; positions stay absolute, so marks and savepoints taken
before a trim still name the same samples.
"""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.scheduler.metrics import SAMPLES_KEPT, SampleLog, latency_summary, percentile

from vmemkv.runtime.models import build_model

from ..hypothesis_budget import examples


class SampleLogMachine(RuleBasedStateMachine):
    """Against a shadow list of every sample ever appended: ``since`` is the shadow's tail from
    the position, less the samples dropped; at most ``2 * keep`` kept, at least the latest
    ``keep`` (or all)."""

    def __init__(self):
        super().__init__()
        self.keep = None
        self.shadow = []
        self.untrimmed = 0           # hot appends since the last trim

    @precondition(lambda self: self.keep is None)
    @rule(keep=st.integers(1, 6))
    def start(self, keep):
        self.keep, self.log = keep, SampleLog(keep)

    @precondition(lambda self: self.keep is not None)
    @rule(value=st.floats(allow_nan=False), hot=st.booleans())
    def append(self, value, hot):
        if hot:                      # the scheduler's hot loop: the array, then one trim()
            self.log.values.append(value)
            self.untrimmed += 1
        else:
            self.log.append(value)
            if len(self.log.values) == self.keep:   # it trimmed
                self.untrimmed = 0
        self.shadow.append(value)

    @precondition(lambda self: self.keep is not None)
    @rule()
    def trim(self):
        self.log.trim()
        self.untrimmed = 0

    @precondition(lambda self: self.keep is not None)
    @rule(data=st.data())
    def truncate(self, data):        # a rolled-back step: only its own, recent, samples
        position = data.draw(st.integers(max(self.log.dropped, len(self.shadow) - self.keep),
                                         len(self.shadow)))
        self.log.truncate(position)
        del self.shadow[position:]

    @precondition(lambda self: self.keep is not None)
    @rule(data=st.data())
    def since(self, data):
        position = data.draw(st.integers(0, len(self.shadow) + 2))
        assert self.log.since(position) == self.shadow[max(position, self.log.dropped):]

    @invariant()
    def bounded_and_exact(self):
        if self.keep is None:
            return
        kept = len(self.log.values)
        assert self.log.end == len(self.shadow) and self.log.dropped + kept == len(self.shadow)
        assert kept < 2 * self.keep + self.untrimmed
        assert self.log.since() == self.shadow[self.log.dropped:]


TestSampleLog = SampleLogMachine.TestCase
TestSampleLog.settings = settings(max_examples=examples(200), stateful_step_count=60,
                                  deadline=None)


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match="keep=0"):
        SampleLog(0)


def test_the_default_keeps_a_million_samples_in_eight_to_sixteen_megabytes():
    log = SampleLog()
    assert log.keep == SAMPLES_KEPT == 1_000_000 and log.values.itemsize == 8


def test_a_long_running_engine_keeps_bounded_samples_and_exact_stats_of_the_last_call():
    """Every generate() is measured from its mark, also after older samples were dropped; the
    logs hold at most 2 x keep samples however many requests the engine served."""
    with Engine(build_model("tiny-llama", seed=0), max_batch=4, max_context=64) as engine:
        logs = (engine.scheduler.metrics.ttft_s, engine.scheduler.metrics.itl_s, engine._kv_usage)
        for log in logs:
            log.keep = 50
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        for _ in range(20):
            outputs = engine.generate([[1, 2, 3]] * 4, params)
            stats = engine.last_stats
            assert len(stats.ttft_s) == 4 and len(stats.itl_s) == 4 * 11
            assert stats.steps == 12 and 0 < stats.kv_usage_mean <= stats.kv_usage_peak <= 1
            assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
        assert engine.scheduler.metrics.itl_s.end == 20 * 44
        assert all(len(log.values) <= 100 for log in logs)
        assert engine.scheduler.metrics.itl_s.dropped >= 20 * 44 - 100
        whole = engine.stats()            # since creation: the kept samples
        assert len(whole.itl_s) == len(logs[1].values) and whole.output_tokens == 20 * 48


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [0.4, 9.0, 2.5, 7.25, 1.0, 3.5, 8.0]])
def test_percentiles_interpolate_as_numpy_does_by_default(values, q):
    """metrics.percentile and the engine's latency_summary (ttft/itl p50, p90, p99) are numpy's
    default linear interpolation; no samples: NaN, not 0."""
    np = pytest.importorskip("numpy")
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    summary = latency_summary("itl", values)
    assert summary["itl_mean_s"] == pytest.approx(sum(values) / len(values))
    assert summary["itl_p90_s"] == pytest.approx(float(np.percentile(values, 90)), rel=1e-12)
    assert all(v != v for v in latency_summary("itl", []).values())
