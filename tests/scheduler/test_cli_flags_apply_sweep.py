"""`vmemkv sweep SPEC` applies `vmemkv simulate`'s rules for which flags do anything
(cli_checks.unused_flags) to its keys: a key that applies to no point of the grid is refused,
one line naming it, exit 2, nothing written (swap_gb without swap preemption, paged_slowdown on
vmem points only, layout on paged points only: each was accepted and ran one simulation under
several labels); a key that applies to some points is used at those and set to its default at
the others, in the run and in the row, so no simulation runs twice."""
import csv
from pathlib import Path

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.sweep import expand, load_spec

CUSTOM = f"{Path(__file__).parent / 'custom_policy.py'}:CoarseBlocks"
BASE = "[base]\nrequests = 8\ncache_gb = 2\n"


def spec_file(tmp_path, text: str) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(BASE + text)
    return str(path)


REFUSED = [
    ('swap_gb = 4\n[grid]\npolicy = ["paged", "vmem"]\n',
     "base.swap_gb applies with --preemption swap (its host swap space)"),
    ('policy = "vmem"\n[grid]\npaged_slowdown = [1.0, 1.5]\n',
     "grid.paged_slowdown applies to --policy paged (its kernels)"),
    ('[grid]\npreemption = ["recompute", "swap"]\nswap_gb = [4, 8]\nlayout = ["per-layer", '
     '"interleaved"]\n', "grid.layout applies to --policy vmem (its pages)"),
    ('[grid]\npolicy = ["reserve-max", "reserve-oracle"]\nwatermark = [0.0, 0.05]\n',
     "grid.watermark applies to paged and vmem"),
    ('[grid]\npolicy = ["paged", "vmem"]\nwatermark_scope = ["growing", "all"]\n',
     "grid.watermark_scope applies with --watermark above 0 to a policy holding"),
]


@pytest.mark.parametrize("text,words", REFUSED, ids=[w.split()[0] for _, w in REFUSED])
def test_a_key_that_applies_to_no_point_is_refused_by_name_and_nothing_is_written(
        tmp_path, capsys, text, words):
    out = tmp_path / "out"
    code = main(["sweep", spec_file(tmp_path, text), "--out", str(out), "--jobs", "1",
                 "--no-progress", "--no-plots"])
    stdout, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("vmemkv sweep: error: "), err
    assert words in err and "no point of the grid is such a run" in err, err
    assert "leave it out" in err and stdout == "" and not out.exists()


def _points(tmp_path, text: str) -> list:
    return expand(load_spec(spec_file(tmp_path, text)))


def test_a_key_some_points_use_is_kept_there_and_set_to_its_default_elsewhere(tmp_path):
    points = _points(tmp_path, 'swap_gb = 4\n[grid]\npolicy = ["paged", "vmem"]\n'
                               'paged_slowdown = [1.0, 1.5]\npreemption = ["recompute", "swap"]\n')
    # paged: 2 slowdowns x 2 preemptions; vmem: 1 x 2 (was 8 points, 4 of them repeats)
    assert [(p["policy"], p["paged_slowdown"], p["preemption"], p["swap_gb"]) for p in points] == [
        ("paged", 1.0, "recompute", 0.0), ("paged", 1.0, "swap", 4),
        ("paged", 1.5, "recompute", 0.0), ("paged", 1.5, "swap", 4),
        ("vmem", 1.0, "recompute", 0.0), ("vmem", 1.0, "swap", 4)]


def test_watermark_and_its_scope_reach_the_reserve_policies_as_in_simulate(tmp_path):
    points = _points(tmp_path, '[grid]\npolicy = ["reserve-max", "vmem"]\n'
                               'watermark = [0.0, 0.05]\nwatermark_scope = ["growing", "all"]\n')
    # vmem: the watermark, not its scope; reserve-max: the watermark only with scope all,
    # and the scope only at a watermark above 0 (0 with scope all is no watermark: the default)
    assert sorted((p["policy"], p["watermark"], p["watermark_scope"]) for p in points) == [
        ("reserve-max", 0.01, "growing"), ("reserve-max", 0.05, "all"),
        ("vmem", 0.0, "growing"), ("vmem", 0.05, "growing")]


def test_a_custom_policy_keeps_the_unit_keys_simulate_builds_it_with(tmp_path):
    points = _points(tmp_path, f'[grid]\npolicy = ["{CUSTOM}", "paged"]\nblock_size = [16, 32]\n'
                               f'map_latency_us = [0.0, 5.0]\n')
    assert sorted((p["policy"] == "paged", p["block_size"], p["map_latency_us"])
                  for p in points) == [
        (False, 16, 0.0), (False, 16, 5.0), (False, 32, 0.0), (False, 32, 5.0),
        (True, 16, 0.0), (True, 32, 0.0)]


def test_the_rows_record_the_default_where_a_key_did_not_apply(tmp_path, capsys):
    out = tmp_path / "out"
    spec = spec_file(tmp_path, 'swap_gb = 4\n[grid]\npreemption = ["recompute", "swap"]\n')
    assert main(["sweep", spec, "--out", str(out), "--jobs", "1", "--no-progress",
                 "--no-plots"]) == 0, capsys.readouterr().err
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["preemption"], float(r["swap_gb"])) for r in rows] == [("recompute", 0.0),
                                                                       ("swap", 4.0)]
