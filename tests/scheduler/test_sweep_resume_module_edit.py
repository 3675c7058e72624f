"""A ``module:Class`` policy is keyed in a sweep by its module file's path and sha256, as a
``file.py:Class`` is: ``vmemkv sweep --resume`` after the module was edited runs its points
again with the new code (it kept the rows the old code computed: the key was the name alone,
and the module, imported once per process, kept running its old code), and keeps them when
the module is unchanged."""
import hashlib
import json
import os
import sys

import pytest

from vmemkv.cli import main
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.sweep import expand, run_local

SWEEP = ["--jobs", "1", "--no-plots", "--no-progress"]
MODULE = "vmemkv_test_sweep_edit_policy"
POLICY = """from vmemkv.scheduler.managers import PagedManager


class Mine(PagedManager):
    def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
        super().__init__(model, cache_bytes, max_seq_len_tokens, block_size_tokens={block})
        self.name = "blocks{block}"
"""


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A folder on sys.path for MODULE; the module is forgotten before and after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield tmp_path
    sys.modules.pop(MODULE, None)


def write_module(folder, block_tokens: int) -> str:
    path = folder / f"{MODULE}.py"
    path.write_text(POLICY.format(block=block_tokens))
    return str(path)


def journal(out) -> dict:
    """The journal's rows by policy."""
    with open(os.path.join(out, "sweep.rows.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {row["policy"]: row for row in rows}


def sweep(tmp_path, *extra) -> dict:
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[base]\nrequests = 8\ncache_gb = 2\n[grid]\n'
                    f'policy = ["{MODULE}:Mine", "paged"]\n')
    out = str(tmp_path / "out")
    assert main(["sweep", str(spec), "--out", out, *SWEEP, *extra]) == 0
    return journal(out)


def test_resume_reruns_the_points_of_an_edited_module_with_its_new_code(module_dir, capsys):
    path = write_module(module_dir, 16)
    first = sweep(module_dir)
    assert first[f"{MODULE}:Mine"]["policy_name"] == "blocks16"
    write_module(module_dir, 1024)          # the researcher edits the module, same process
    capsys.readouterr()
    rows = sweep(module_dir, "--resume")
    custom = rows[f"{MODULE}:Mine"]
    assert custom["policy_name"] == "blocks1024"      # was blocks16: the old code's row was kept
    assert rows["paged"] == first["paged"]            # the built-in's row is kept as it was
    with open(path, "rb") as f:
        assert custom["policy_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert custom["policy_path"] == os.path.realpath(path)
    assert "# 1 rows kept from the journal" in capsys.readouterr().out


def test_resume_keeps_the_rows_of_an_unchanged_module(module_dir, capsys):
    write_module(module_dir, 16)
    first = sweep(module_dir)
    capsys.readouterr()
    assert sweep(module_dir, "--resume") == first
    assert "# 2 rows kept from the journal" in capsys.readouterr().out


def test_a_module_edited_while_the_sweep_runs_fails_its_point_by_name(module_dir):
    write_module(module_dir, 16)
    (point,) = expand({"base": {"requests": 8, "cache_gb": 2, "policy": f"{MODULE}:Mine"},
                       "grid": {}})
    write_module(module_dir, 1024)           # after the point was keyed, before it runs
    (row,) = run_local([point], jobs=1)
    assert "changed since the sweep read it" in row["error"]
    assert row["policy_sha256"] == point["policy_sha256"] and "policy_name" not in row


def test_a_module_without_a_source_file_is_refused_by_name(monkeypatch):
    import types
    from vmemkv.scheduler.managers import PagedManager
    module = types.ModuleType("vmemkv_test_in_memory_policy")
    module.__spec__ = None

    class Mine(PagedManager):
        def __init__(self, model, cache_bytes, max_seq_len_tokens, **options):
            super().__init__(model, cache_bytes, max_seq_len_tokens)

    module.Mine = Mine
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(ConfigError, match=r"module vmemkv_test_in_memory_policy has no Python "
                                          r"source file \(none\) .*put the class in a \.py file"):
        expand({"base": {"requests": 8, "cache_gb": 2,
                         "policy": "vmemkv_test_in_memory_policy:Mine"}, "grid": {}})
