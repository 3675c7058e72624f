"""A policy file is known by its resolved path and its bytes: two files with one basename are two
classes, a file edited in a running session is loaded again, and a sweep keys (and `--resume`
reruns) a point by the file's path and sha256, as it does a trace file."""
import hashlib
import json
import os

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.policies import load_policy_class
from vmemkv.scheduler.simulator import SimConfig
from vmemkv.scheduler.sweep import expand, point_key, run_local

SWEEP = ["--jobs", "1", "--no-plots", "--no-progress"]
POLICY = """from vmemkv.scheduler.managers import PagedManager


class Mine(PagedManager):
    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens={block})
        self.name = "blocks{block}"
"""


def write_policy(path, block_tokens: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(POLICY.format(block=block_tokens))
    return str(path)


def built_name(spec: str) -> str:
    return SimConfig(policy=spec, cache_bytes=10**9).make_manager().name


def journal(out) -> list:
    with open(os.path.join(out, "sweep.rows.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_two_policy_files_with_one_basename_are_two_classes(tmp_path):
    v1 = write_policy(tmp_path / "v1" / "policy.py", 16)
    v2 = write_policy(tmp_path / "v2" / "policy.py", 1024)
    assert load_policy_class(f"{v1}:Mine") is not load_policy_class(f"{v2}:Mine")
    assert (built_name(f"{v1}:Mine"), built_name(f"{v2}:Mine")) == ("blocks16", "blocks1024")
    assert load_policy_class(f"{v1}:Mine") is load_policy_class(f"{v1}:Mine")   # loaded once


def test_a_policy_file_edited_in_one_session_is_loaded_again(tmp_path):
    path = write_policy(tmp_path / "policy.py", 16)
    assert built_name(f"{path}:Mine") == "blocks16"
    write_policy(tmp_path / "policy.py", 64)      # same size, maybe the same mtime second
    assert built_name(f"{path}:Mine") == "blocks64"


def test_a_sweep_of_two_files_with_one_basename_runs_each(tmp_path):
    v1 = write_policy(tmp_path / "v1" / "policy.py", 16)
    v2 = write_policy(tmp_path / "v2" / "policy.py", 1024)
    points = expand({"base": {"requests": 8, "cache_gb": 2},
                     "grid": {"policy": [f"{v1}:Mine", f"{v2}:Mine"]}})
    rows = run_local(points, jobs=1)
    assert [r["policy_name"] for r in rows] == ["blocks16", "blocks1024"]
    assert [r["policy_path"] for r in rows] == [os.path.realpath(v1), os.path.realpath(v2)]


def test_resume_reruns_the_points_of_an_edited_policy_file(tmp_path, capsys):
    path = write_policy(tmp_path / "pol.py", 16)
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[base]\nrequests = 8\ncache_gb = 2\n[grid]\npolicy = ["{path}:Mine"]\n')
    out = str(tmp_path / "out")
    assert main(["sweep", str(spec), "--out", out] + SWEEP) == 0
    assert journal(out)[0]["policy_name"] == "blocks16"
    write_policy(tmp_path / "pol.py", 1024)           # the researcher edits the policy
    capsys.readouterr()
    assert main(["sweep", str(spec), "--out", out, "--resume"] + SWEEP) == 0
    (row,) = journal(out)
    assert row["policy_name"] == "blocks1024"        # was blocks16: the old file's row was kept
    with open(path, "rb") as f:
        assert row["policy_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert row["policy_path"] == os.path.realpath(path)
    assert "kept from the journal" not in capsys.readouterr().out


def test_a_journal_row_without_the_policy_file_key_runs_again_and_a_builtin_is_kept(tmp_path):
    path = write_policy(tmp_path / "pol.py", 16)
    file_point, builtin_point = expand({"base": {"requests": 8, "cache_gb": 2},
                                        "grid": {"policy": [f"{path}:Mine", "paged"]}})
    old_rows = [{k: v for k, v in p.items() if k not in ("policy_path", "policy_sha256")}
                for p in (file_point, builtin_point)]          # a journal from before the key
    assert point_key(old_rows[0]) != point_key(file_point)
    assert point_key(old_rows[1]) == point_key(builtin_point)
    assert builtin_point["policy_sha256"] is None


def test_a_policy_file_edited_while_the_sweep_runs_fails_its_point_by_name(tmp_path):
    path = write_policy(tmp_path / "pol.py", 16)
    (point,) = expand({"base": {"requests": 8, "cache_gb": 2, "policy": f"{path}:Mine"},
                       "grid": {}})
    write_policy(tmp_path / "pol.py", 1024)           # after the point was keyed, before it runs
    (row,) = run_local([point], jobs=1)
    assert "changed since the sweep read it" in row["error"]
    assert row["policy_sha256"] == point["policy_sha256"] and "policy_name" not in row


def test_a_policy_file_whose_import_failed_is_imported_again_when_next_named(tmp_path,
                                                                              monkeypatch):
    """A failed import is not cached: the same bytes, once what they import is there, load
    (the half-run module kept in sys.modules had no class, named as missing)."""
    path = tmp_path / "flaky.py"
    path.write_text("import os\nif not os.environ.get('VMEMKV_TEST_POLICY_READY'):\n"
                    "    raise RuntimeError('not ready')\n" + POLICY.format(block=32))
    monkeypatch.delenv("VMEMKV_TEST_POLICY_READY", raising=False)
    with pytest.raises(ConfigError, match=r"flaky\.py raised RuntimeError: not ready"):
        load_policy_class(f"{path}:Mine")
    monkeypatch.setenv("VMEMKV_TEST_POLICY_READY", "1")
    assert load_policy_class(f"{path}:Mine").__name__ == "Mine"
