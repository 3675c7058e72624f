"""A sweep's table and grid, as a user of custom policies meets them: a fresh sweep's table is
the one --resume writes (a NaN figure was `nan` in the first and empty in the second), and one
policy file or trace named two ways is refused as the repeated value it is (it ran one
simulation twice under two labels)."""
import json
import os

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.sweep import expand, load_spec

POLICY = """from vmemkv.scheduler.managers import PagedManager


class Coarse(PagedManager):
    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=64)
"""


def _sweep(tmp_path, spec: str, *extra: str) -> int:
    (tmp_path / "s.toml").write_text(spec)
    return main(["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out"), "--jobs",
                 "1", "--no-progress", "--no-plots", *extra])


def test_a_resumed_sweep_writes_the_table_a_fresh_one_wrote_nan_figures_included(tmp_path):
    trace = tmp_path / "one_token.jsonl"        # one output token each: TPOT and ITL are NaN
    trace.write_text("".join(json.dumps({"prompt_len": 40 + i, "output_len": 1,
                                         "arrival_s": i * 0.1}) + "\n" for i in range(4)))
    spec = f'[base]\nmodel = "tiny"\ntrace = "{trace}"\n[grid]\npolicy = ["paged", "vmem"]\n'
    assert _sweep(tmp_path, spec) == 0
    fresh = (tmp_path / "out" / "sweep.csv").read_text()
    assert _sweep(tmp_path, spec, "--resume") == 0
    resumed = (tmp_path / "out" / "sweep.csv").read_text()
    assert resumed == fresh
    header, *rows = fresh.splitlines()
    tpot = header.split(",").index("median_tpot_ms")
    assert len(rows) == 2 and [row.split(",")[tpot] for row in rows] == ["", ""]


def test_one_policy_file_named_two_ways_is_refused_naming_both_points(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pol.py").write_text(POLICY)
    spec = ('[base]\nmodel = "tiny"\nrequests = 5\n[grid]\n'
            'policy = ["pol.py:Coarse", "./pol.py:Coarse", "paged"]\n')
    (tmp_path / "s.toml").write_text(spec)
    with pytest.raises(ConfigError, match=r"point policy = './pol.py:Coarse' is point policy = "
                       r"'pol.py:Coarse' spelled another way \(policy file .*pol.py\)"):
        expand(load_spec("s.toml"))
    assert _sweep(tmp_path, spec) == 2
    assert not os.path.exists(tmp_path / "out")          # refused before anything is written
    assert "spelled another way" in capsys.readouterr().err


def test_a_policy_module_and_its_file_are_one_class(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pol_hunt30.py").write_text(POLICY)
    spec = ('[base]\nmodel = "tiny"\nrequests = 5\n[grid]\n'
            'policy = ["pol_hunt30:Coarse", "pol_hunt30.py:Coarse"]\ncache_gb = [1, 2]\n')
    (tmp_path / "s.toml").write_text(spec)
    with pytest.raises(ConfigError, match=r"point policy = 'pol_hunt30.py:Coarse', cache_gb = 1 "
                                          r"is point policy = 'pol_hunt30:Coarse', cache_gb = 1"):
        expand(load_spec("s.toml"))


def test_one_trace_file_named_two_ways_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jsonl").write_text('{"prompt_len": 30, "output_len": 4, "arrival_s": 0}\n')
    spec = '[base]\nmodel = "tiny"\n[grid]\ntrace = ["t.jsonl", "./t.jsonl"]\n'
    (tmp_path / "s.toml").write_text(spec)
    with pytest.raises(ConfigError, match=r"point trace = './t.jsonl' is point trace = 't.jsonl' "
                                          r"spelled another way \(trace file .*t.jsonl\)"):
        expand(load_spec("s.toml"))



def test_a_journal_row_with_a_value_no_spec_gives_is_left_out_by_resume(tmp_path):
    spec = '[base]\nmodel = "tiny"\nrequests = 5\n[grid]\npolicy = ["paged", "vmem"]\n'
    assert _sweep(tmp_path, spec) == 0
    journal = tmp_path / "out" / "sweep.rows.jsonl"
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    journal.write_text("".join(json.dumps(r) + "\n"
                               for r in rows + [{**rows[0], "page_bytes": "bogus"}]))
    assert _sweep(tmp_path, spec, "--resume") == 0      # it was a ConfigError naming no file
    assert [json.loads(line) for line in journal.read_text().splitlines()] == rows
