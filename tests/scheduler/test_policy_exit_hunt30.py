"""A custom policy that calls sys.exit: one point's failure in a sweep (it ended the whole
sweep, no table, the later points never run), and a ConfigError naming the policy when its
module exits on import (a script's module-level argparse read vmemkv's own argv and printed
"usage: vmemkv [-h] [--lr LR] ... unrecognized arguments: simulate ...", as if vmemkv refused
its own flags)."""
import csv

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.policies import load_policy_class
from vmemkv.scheduler.sweep import expand, load_spec

EXITS = """import sys
from vmemkv.scheduler.managers import PagedManager


class Exits(PagedManager):
    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens=16)

    def allocate(self, *args, **kwargs):
        sys.exit("policy gave up")
"""
SCRIPT = """import argparse
from vmemkv.scheduler.managers import PagedManager
args = argparse.ArgumentParser().parse_args(["--lr", "0.1"])   # exits 2: no such option


class Mine(PagedManager):
    pass
"""


def test_a_point_whose_policy_calls_sys_exit_is_its_row_and_the_others_run(tmp_path,
                                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exits.py").write_text(EXITS)
    (tmp_path / "s.toml").write_text('[base]\nmodel = "tiny"\nrequests = 5\n[grid]\n'
                                     'policy = ["exits.py:Exits", "paged"]\n')
    assert main(["sweep", "s.toml", "--out", "out", "--jobs", "1", "--no-progress",
                 "--no-plots"]) == 1
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep.csv", encoding="utf-8")))
    assert [(r["policy"], r["error"]) for r in rows] == \
        [("exits.py:Exits", "SystemExit: policy gave up"), ("paged", "")]
    assert int(rows[1]["num_requests"]) == 5


def test_a_policy_file_that_exits_on_import_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    spec = f"{tmp_path}/script.py:Mine"
    with pytest.raises(ConfigError, match=r"custom policy '.*script.py:Mine': importing "
                                          r".*script.py raised SystemExit: 2"):
        load_policy_class(spec)


def test_a_policy_module_that_exits_on_import_is_refused_by_a_sweep_naming_it(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "script_hunt30.py").write_text(SCRIPT)
    (tmp_path / "s.toml").write_text('[base]\nmodel = "tiny"\nrequests = 5\n[grid]\n'
                                     'policy = ["paged", "script_hunt30:Mine"]\n')
    with pytest.raises(ConfigError, match=r"point policy = 'script_hunt30:Mine': custom policy "
                                          r"'script_hunt30:Mine': importing script_hunt30 "
                                          r"raised SystemExit: 2"):
        expand(load_spec("s.toml"))


def test_a_policy_whose_constructor_calls_sys_exit_is_its_points_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ctor.py").write_text(EXITS.replace('super().__init__(', 'sys.exit("no build")'
                                                    '\n        super().__init__('))
    (tmp_path / "s.toml").write_text('[base]\nmodel = "tiny"\nrequests = 5\n[grid]\n'
                                     'policy = ["ctor.py:Exits", "paged"]\n')
    assert main(["sweep", "s.toml", "--out", "out", "--jobs", "1", "--no-progress",
                 "--no-plots"]) == 1
    rows = list(csv.DictReader(open(tmp_path / "out" / "sweep.csv", encoding="utf-8")))
    assert [(r["policy"], r["error"]) for r in rows] == \
        [("ctor.py:Exits", "SystemExit: no build"), ("paged", "")]
