"""A beam search of width K returns K hypotheses of output_len tokens, as the engine does: with
max_new_tokens=1 its one step (the lone prompt's) ends the group, and beam_select keeps K
one-token hypotheses (every candidate hits the length). SimResult.output_tokens and its
tokens/s count them as the serving report does; the shortcut for the last token counted the
lone prompt sequence's one token (2 against the report's 8 for two requests of width 4)."""
import pytest

from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry


@pytest.mark.parametrize("output_len", [1, 2, 5])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_output_tokens_are_width_times_output_len_in_result_and_report(output_len, width):
    entries = [TraceEntry(100, output_len, 0.0), TraceEntry(60, output_len, 0.5)]
    result = simulate(entries, SimConfig(cache_bytes=2 * 10**9, beam_width=width))
    expected = len(entries) * width * output_len
    assert result.output_tokens == expected
    assert result.serving["total_output_tokens"] == expected
    assert result.output_tokens_per_s * result.simulated_seconds == pytest.approx(expected)
    assert result.serving["output_throughput"] * result.serving["duration"] == pytest.approx(
        expected)


def test_one_token_beams_hold_no_forked_memory():
    # the engine never forks a group its first step ends: nothing copied, nothing failed
    result = simulate([TraceEntry(100, 1, 0.0)] * 3, SimConfig(cache_bytes=2 * 10**9,
                                                                beam_width=4))
    assert result.copied_kv_bytes == 0 and result.failed_requests == 0
