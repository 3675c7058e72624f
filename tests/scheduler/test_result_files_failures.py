"""Result files when a write fails (a full disk, a file-size limit) and written through links.

- streamed_open: a log whose write fails keeps the old log (the cut-short ``.partial`` was
  renamed over it) and the error names the log (it named no file).
- the sweep journal: a failing append names sweep.rows.jsonl and says --resume goes on.
- a link is written through: its target is replaced, the link kept; a dangling link is fine
  when its target's folder exists, refused naming it when not (sweep and bench refused every one).
- STALE.txt after a sweep or bench that ended with an error says it failed ("has not finished").
The failures are a file object's write or a writer that raises OSError(EFBIG/ENOSPC) in process.
"""
import errno
import json
import os

import pytest

from vmemkv.benchmarks import suite
from vmemkv.cli import main
from vmemkv.scheduler import cli_sweep
from vmemkv.scheduler.cliargs import file_problem
from vmemkv.scheduler.result_files import (STALE_NAME, atomic_open, folder_problem, streamed_open,
                                           write_atomic, write_json)
from vmemkv.scheduler.sweep_journal import JOURNAL_NAME, RowJournal


class FailingWrites:
    """A file whose writes fail as on a file over RLIMIT_FSIZE (EFBIG, no file name)."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, text):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_log_whose_write_fails_keeps_the_old_log_and_names_it(tmp_path):
    log_path = tmp_path / "bench.log"
    log_path.write_text("the whole old log\n")
    with pytest.raises(OSError) as raised:
        with streamed_open(str(log_path)) as log:
            log.write("the new run's first line\n")
            log.flush()
            FailingWrites(log).write("a line over the limit\n")
    assert raised.value.errno == errno.EFBIG and raised.value.filename == str(log_path)
    assert log_path.read_text() == "the whole old log\n"
    assert sorted(os.listdir(tmp_path)) == ["bench.log"]      # no cut-short .partial left


def test_a_log_ended_by_another_error_is_still_whole_in_place(tmp_path):
    log_path = tmp_path / "bench.log"
    log_path.write_text("old\n")
    with pytest.raises(ValueError):
        with streamed_open(str(log_path)) as log:
            log.write("logged before the error\n")
            raise ValueError("a section's own failure")
    assert log_path.read_text() == "logged before the error\n"


def test_a_failing_journal_append_names_the_journal_and_resume(tmp_path):
    with RowJournal(str(tmp_path), [], resume=False) as journal:
        journal.append({"row": 1})
        journal._file = FailingWrites(journal._file)
        with pytest.raises(OSError) as raised:
            journal.append({"row": 2})
        journal._file = journal._file.file
    assert raised.value.errno == errno.EFBIG
    assert raised.value.filename == str(tmp_path / JOURNAL_NAME)
    assert "--resume" in str(raised.value)
    assert [json.loads(line) for line in (tmp_path / JOURNAL_NAME).read_text().splitlines()] \
        == [{"row": 1}]


@pytest.mark.parametrize("write", [
    lambda path: write_json(path, {"run": "new"}),
    lambda path: write_atomic(path, lambda tmp: open(tmp, "w").write('{"run": "new"}')),
])
def test_a_write_through_a_link_replaces_its_target_and_keeps_the_link(tmp_path, write):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "out.json"
    target.write_text("OLD")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write(str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) == {"run": "new"}
    assert os.listdir(tmp_path / "real") == ["out.json"]      # the temporary file was beside it


def test_a_log_through_a_link_replaces_its_target(tmp_path):
    target = tmp_path / "real.log"
    target.write_text("OLD\n")
    link = tmp_path / "bench.log"
    link.symlink_to(target)
    with streamed_open(str(link)) as log:
        log.write("new\n")
    assert link.is_symlink() and target.read_text() == "new\n"


def test_a_dangling_link_is_created_when_its_target_folder_exists_else_refused(tmp_path):
    fine = tmp_path / "fine.json"
    fine.symlink_to(tmp_path / "made.json")
    assert file_problem(str(fine)) is None
    assert folder_problem(str(tmp_path), ["fine.json"]) is None     # sweep/bench: the same rule
    with atomic_open(str(fine)) as f:
        f.write("new")
    assert fine.is_symlink() and (tmp_path / "made.json").read_text() == "new"
    nowhere = tmp_path / "nowhere.json"
    nowhere.symlink_to(tmp_path / "missing" / "t.json")
    problem = file_problem(str(nowhere))
    assert problem == (f"{nowhere} is a link to {tmp_path / 'missing' / 't.json'}, whose folder "
                       f"{tmp_path / 'missing'} does not exist: create it or give another file "
                       f"name")
    assert folder_problem(str(tmp_path), ["nowhere.json"]) == f"{tmp_path}: {problem}"


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def stale_status(folder) -> str:
    return (folder / STALE_NAME).read_text().splitlines()[0]


def test_a_sweep_that_fails_says_so_in_stale(tmp_path, monkeypatch, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text("[base]\nrequests = 20\n[grid]\ncache_gb = [1]\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.csv").write_text("an earlier run's table")
    monkeypatch.setattr(cli_sweep, "write_table", full_disk)
    assert main(["sweep", str(spec), "--out", str(out), "--jobs", "1", "--no-progress",
                 "--no-plots"]) != 0       # the exit code of an OSError is vmemkv.cli's
    status = stale_status(out)
    assert "has not finished" not in status
    assert "(it failed: OSError: [Errno 28] No space left on device) without rewriting them" \
        in status
    assert (out / "sweep.csv").read_text() == "an earlier run's table"


def test_a_bench_that_fails_says_so_in_stale(tmp_path, monkeypatch):
    (tmp_path / "bench.json").write_text("an earlier run's")
    monkeypatch.setattr(suite, "_call", lambda section, *args, **kwargs: {"results": []})
    monkeypatch.setattr(suite, "write_json", full_disk)
    with pytest.raises(OSError):
        suite.run_suite(out_dir=str(tmp_path), device="cpu", sections=("alloc",), plots=False,
                        progress=False)
    status = stale_status(tmp_path)
    assert "has not finished" not in status
    assert "(it failed: OSError: [Errno 28] No space left on device)" in status
    assert (tmp_path / "bench.json").read_text() == "an earlier run's"
