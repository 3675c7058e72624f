"""sweep.rows.jsonl is strict JSON: a figure that is not finite is null, as simulate --json
writes it (it was a bare NaN, which JSON readers other than Python's refuse), and --resume
still keeps such a row."""
import json
import math

from vmemkv.cli import main
from vmemkv.scheduler.sweep import expand, load_spec
from vmemkv.scheduler.sweep_journal import RowJournal

SPEC = '[base]\nrequests = 20\nmodel = "tiny"\n[grid]\npolicy = ["vmem", "paged"]\n'


def _strict(constant):
    raise ValueError(f"not JSON: {constant}")


def test_a_nan_figure_is_null_in_the_journal_and_a_resume_keeps_its_row(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC)
    points = expand(load_spec(str(tmp_path / "s.toml")), 10)
    rows = [{**p, "median_tpot_ms": math.nan, "p90_ttft_ms": math.inf, "error": None}
            for p in points]
    with RowJournal(str(tmp_path), points, resume=False) as journal:
        for row in rows:
            journal.append(row)
    lines = (tmp_path / "sweep.rows.jsonl").read_text().splitlines()
    parsed = [json.loads(line, parse_constant=_strict) for line in lines]
    assert [(r["median_tpot_ms"], r["p90_ttft_ms"]) for r in parsed] == [(None, None)] * 2
    with RowJournal(str(tmp_path), points, resume=True) as journal:
        assert len(journal.kept) == 2
        assert all(r["median_tpot_ms"] is None for r in journal.kept.values())


def test_a_resumed_sweep_with_null_figures_writes_its_table(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC)
    args = ["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--jobs", "1",
            "--no-progress", "--no-plots"]
    assert main(args) == 0
    journal = tmp_path / "o" / "sweep.rows.jsonl"
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    rows[0]["median_tpot_ms"] = None                 # as a NaN figure is written
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(args + ["--resume"]) == 0
    kept = [json.loads(line, parse_constant=_strict) for line in journal.read_text().splitlines()]
    assert kept[0]["median_tpot_ms"] is None and len(kept) == 2
    assert (tmp_path / "o" / "sweep.csv").read_text().count("\n") == 3
