"""Capacity search: an SLO target on a figure the workload does not have (TPOT or ITL when every
request has one output token: NaN) is refused by name, not reported as "no load meets it"."""
import math

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.capacity import UndefinedSloTarget, check_defined, find_max_load
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.simulator import SimConfig
from vmemkv.scheduler.workload import TraceEntry, write_trace

CONFIG = SimConfig(cache_bytes=2 * 10**9)


def one_token_outputs(load: float):
    return [TraceEntry(200, 1, 0.1 * i / load) for i in range(20)]


@pytest.mark.parametrize("target", ["tpot_p99", "itl_mean"])
def test_a_target_the_workload_has_no_figure_for_is_refused_by_name(target):
    probes = []
    with pytest.raises(UndefinedSloTarget, match=rf"SLO target {target}: .* is undefined on this "
                                                 r"workload \(no request has two output tokens"):
        find_max_load(one_token_outputs, CONFIG, {"ttft_p90": 2000.0, target: 200.0},
                      max_probes=4, on_probe=probes.append)
    assert probes == []        # refused at the first probe: no verdict was recorded


def test_defined_targets_on_the_same_workload_still_search():
    result = find_max_load(one_token_outputs, CONFIG, {"ttft_p90": 2000.0}, max_probes=4)
    assert result.max_load is not None and all(p.meets for p in result.probes)


def test_a_report_with_no_completed_request_says_so():
    report = {"completed": 0, "p90_ttft_ms": math.nan}
    with pytest.raises(ConfigError, match=r"ttft_p90: p90_ttft_ms is undefined .*no request "
                                          r"completed"):
        check_defined({"ttft_p90": 100.0}, report)
    check_defined({}, report)           # no target: nothing to refuse


def test_find_max_rate_cli_refuses_the_target_in_one_line_exit_2(tmp_path, capsys):
    trace = str(tmp_path / "one_tok.jsonl")
    write_trace(trace, one_token_outputs(1.0))
    argv = ["simulate", "--find-max-rate", "--slo", "tpot_p99=200", "--trace", trace,
            "--cache-gb", "2", "--max-probes", "4", "--no-progress"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "UndefinedSloTarget: SLO target tpot_p99: p99_tpot_ms is undefined" in line
    assert "no probed load" not in captured.err
