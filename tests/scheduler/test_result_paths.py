"""Result paths are checked before a run's work (scheduler/cliargs.file_problem,
result_files.folder_problem): a path the check passes can be written, a path that cannot be
written is refused naming it, and a write that fails later names its path."""
import errno
import os

import pytest

from vmemkv.scheduler.cliargs import file_problem
from vmemkv.scheduler.result_files import folder_problem, streamed_open, write_text


def test_a_name_the_file_system_takes_passes_and_is_written(tmp_path):
    path = str(tmp_path / ("b" * 245 + ".json"))       # 250 bytes: legal, but .NAME.XXXXXXXX.tmp is not
    assert file_problem(path) is None
    assert write_text(path, "whole") == path
    assert open(path).read() == "whole"
    assert os.listdir(tmp_path) == [os.path.basename(path)]     # no temporary file left


def test_a_missing_folder_with_a_name_too_long_is_refused_naming_it(tmp_path):
    path = str(tmp_path / ("d" * 300) / "out.jsonl")
    problem = file_problem(path)
    assert problem is not None and problem.startswith(path)
    assert "300 bytes" in problem and "at most 255" in problem
    assert file_problem(str(tmp_path / ("f" * 256))) is not None       # the file's own name too
    assert os.listdir(tmp_path) == []


def test_a_folder_that_is_a_link_to_nowhere_is_refused_naming_it(tmp_path):
    os.symlink("/nonexistent/zz", tmp_path / "dl")
    problem = file_problem(str(tmp_path / "dl" / "out.jsonl"))
    assert problem is not None
    assert f"{tmp_path / 'dl'} is a link to a missing folder (/nonexistent/zz)" in problem


class _Full:
    """os.statvfs of a file system with no block left (of 4,096)."""
    f_blocks, f_bavail, f_bfree = 4096, 0, 0


def test_a_file_system_with_no_space_left_is_refused_naming_the_path(tmp_path, monkeypatch):
    path = str(tmp_path / "sub" / "r.json")
    monkeypatch.setattr(os, "statvfs", lambda folder: _Full())
    problem = file_problem(path)
    assert problem == (f"{path}: the file system of {tmp_path} has no space left (0 bytes "
                       f"free): the run's results could not be written")
    assert folder_problem(str(tmp_path / "out")).startswith(f"{tmp_path / 'out'}: ")


def test_a_write_that_runs_out_of_space_names_its_path_and_leaves_the_old_file(tmp_path,
                                                                              monkeypatch):
    path = str(tmp_path / "r.json")
    write_text(path, "old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        write_text(path, "new")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == path
    assert str(caught.value) == f"[Errno 28] No space left on device: '{path}'"
    with pytest.raises(OSError) as caught, streamed_open(str(tmp_path / "run.log")) as log:
        log.write("line\n")
    assert caught.value.filename == str(tmp_path / "run.log")    # the log it could not write
    assert open(path).read() == "old" and sorted(os.listdir(tmp_path)) == ["r.json"]


def test_a_rewritten_file_keeps_its_permissions_and_a_new_one_follows_the_umask(tmp_path):
    private, new = str(tmp_path / "private.json"), str(tmp_path / "new.json")
    write_text(private, "old")
    os.chmod(private, 0o600)
    mask = os.umask(0o022)
    try:
        write_text(private, "rewritten")
        write_text(new, "new")
    finally:
        os.umask(mask)
    assert open(private).read() == "rewritten"
    assert oct(os.stat(private).st_mode & 0o777) == oct(0o600)       # it became 0644
    assert oct(os.stat(new).st_mode & 0o777) == oct(0o644)
