"""benchmarks/elastic.py replays on a step clock: its figures do not depend on how fast the
machine steps (on the wall clock, its documented 7.3x had become 0.9x two days of engine
speed-ups later), so two runs agree exactly and the budget's effect is asserted, not timed."""
from vmemkv.benchmarks.elastic import run


def _figures(payload) -> list:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in payload["rows"]]


def test_the_quick_replay_is_exact_and_the_shared_budget_cuts_ttft(capsys):
    first, second = run(quick=True), run(quick=True)
    capsys.readouterr()
    assert _figures(first) == _figures(second)
    assert first["tokens_identical"]
    static, shared = _figures(first)
    assert shared["ttft_p90_steps"] < static["ttft_p90_steps"] / 2
    assert shared["peak_KiB_tiny-llama"] > static["peak_KiB_tiny-llama"]   # it grew
    assert shared["grows"] > 0 and shared["gives"] > 0
