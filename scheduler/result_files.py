"""Every file the project writes goes through here: whole, or not at all.

    write_atomic(path, writer)   writer(tmp) fills a temporary file beside ``path`` (same folder,
                                 so the same file system); it is flushed to disk, then
                                 os.replace(tmp, path) swaps it in. A kill at any moment leaves
                                 the old file or the new one, never a mix; on an exception the
                                 temporary file is removed and the old file stays (a write's
                                 OSError with no file name, ENOSPC say, is raised naming path);
                                 a file rewritten keeps its permissions
    atomic_open(path, mode)      the same as a context manager around an open file
    streamed_open(path)          a log written as the run goes: ``path.partial`` until it ends
    write_json / write_text      the usual cases

A link is written through: every writer here resolves ``path`` (os.path.realpath) first, so the
temporary file sits beside the link's target and the target is what is replaced (the link
stays a link). A dangling link is the same: its target is created, when the target's folder
exists (``cliargs.file_problem`` refuses one whose target folder is missing, naming it).

A run that writes several files into one folder marks what is stale (``StaleMarker``): at its
start it lists the files an earlier run left there in ``STALE.txt``; each file it rewrites
leaves the list (any write here of a listed name does, after the run too: ``unlist``); at its end the marker is removed, or kept naming what the run did not rewrite
(a run cut short by Ctrl-C draws no plots, so the old PNGs are still there). After a kill -9 the
marker names every old file beside the new run's partial ones (written as ``*.partial``).
Pure Python (scheduler, runtime and benchmarks all use it).
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from typing import Callable, Iterable, Iterator, Optional

from .cliargs import file_problem, hold_point, name_max_bytes, temp_prefix

STALE_NAME = "STALE.txt"


@contextlib.contextmanager
def _replacing(path: str) -> Iterator[str]:
    """A temporary path beside ``path``; when the block ends normally it is flushed to disk and
    replaces ``path``, when it raises (KeyboardInterrupt too) it is removed."""
    target = _target(path)
    folder = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target, name_max_bytes(folder)), suffix=".tmp",
                               dir=folder)
    os.close(fd)
    try:
        yield tmp
        hold_point(f"write:{os.path.basename(path)}")   # tests: a kill between write and replace
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _mode(target))
        os.replace(tmp, target)
        unlist(path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(error, OSError) and error.filename is None:
            raise naming(error, path) from error
        raise


def _target(path: str) -> str:
    """The file a write of ``path`` replaces: ``path`` itself, or the file a link there points
    to (a link's target is written, the link kept); the folder of ``path`` is created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return os.path.realpath(path)


def unlist(path: str) -> None:
    """``path`` was just written: if its folder's ``STALE.txt`` names it, it leaves the list
    (the marker goes with the last name). A file a command writes after its run's marker has
    finished (``vmemkv bench --prefix-eviction``'s prefix.json) is then not called stale."""
    folder, name = os.path.split(os.path.abspath(path))
    marker = os.path.join(folder, STALE_NAME)
    if name == STALE_NAME or not os.path.isfile(marker):
        return
    with open(marker, encoding="utf-8") as f:
        head, *names = f.read().splitlines()
    if name not in names:
        return
    names = [n for n in names if n != name]
    if not names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)
        return
    write_text(marker, head + "\n" + "".join(f"{n}\n" for n in names))


def naming(error: OSError, path: str) -> OSError:
    """``error`` (a write's ENOSPC, EIO, EDQUOT: no file name) as the same OSError naming
    ``path``, so that a run's last line says which result was lost."""
    return OSError(error.errno, error.strerror, path)


def write_atomic(path: str, writer: Callable[[str], None]) -> str:
    """Call ``writer(tmp_path)`` to write a temporary file beside ``path``, then replace
    ``path`` by it; returns ``path``. The folder is created."""
    with _replacing(path) as tmp:
        writer(tmp)
    return path


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **kwargs) -> Iterator:
    """``with atomic_open(path) as f: f.write(...)``: ``path`` is replaced when the block
    ends normally, untouched when it raises."""
    with _replacing(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


@contextlib.contextmanager
def streamed_open(path: str, mode: str = "w", **kwargs) -> Iterator:
    """A file written as the run goes (a log): it grows as ``path + ".partial"`` (beside a
    link's target) and becomes ``path`` when the block ends, however it ends (an exception or
    Ctrl-C too: what was logged is whole). When writing the log itself fails (an OSError naming
    no file or the ``.partial``: ENOSPC, EFBIG, EIO) the log is cut short: the ``.partial`` is
    removed, the old ``path`` stays as it was, and the error is raised naming ``path``. A kill
    leaves the ``.partial`` file and the old ``path`` as they were."""
    target = _target(path)
    partial = target + ".partial"
    log = open(partial, mode, **kwargs)   # a folder or a device there: raised, nothing replaced
    try:
        with log:
            yield log
            log.flush()
            os.fsync(log.fileno())
    except OSError as error:
        if error.filename not in (None, partial):   # not the log's own write: the log is whole
            _settle(partial, target, path)
            raise
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise naming(error, path) from error
    except BaseException:
        _settle(partial, target, path)
        raise
    _settle(partial, target, path)


def _settle(partial: str, target: str, path: str) -> None:
    """A whole log ``partial`` replaces ``target`` (``path``, or its link's target)."""
    if os.path.exists(partial):
        os.replace(partial, target)
        unlist(path)


def write_json(path: str, payload, **dump_kwargs) -> str:
    """``payload`` as JSON at ``path`` (indent 1 unless given), atomically."""
    dump_kwargs.setdefault("indent", 1)
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, **dump_kwargs)
    return path


def write_text(path: str, text: str) -> str:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _mode(path: str) -> int:
    """The permissions a rewritten ``path`` keeps (an existing file's own: a 0600 result stayed
    private only until it was rewritten as 0644), else the umask's (mkstemp's 0600 would make
    new results private)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def folder_problem(path: str, names: Iterable[str] = ()) -> Optional[str]:
    """Why a run cannot write its files into the folder ``path`` (created with the folders
    above it when missing), or None: not a file or a device, in a folder we may write in
    (``cliargs.file_problem`` of a file inside it), and each of ``names`` (the files the run
    writes there; ``*.png``-style patterns: the files there they match) a regular file or
    absent (a folder at ``sweep.csv`` was found by os.replace after the whole run); a link
    is judged by ``file_problem`` (written through, see the module docstring)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is not a folder (a file is there): give a folder"
    problem = file_problem(os.path.join(path, STALE_NAME))
    if problem:
        return f"{path}: {problem}"
    for name in names:
        for member in _members(path, name):
            if os.path.lexists(member) and not (os.path.isfile(member)
                                                 or os.path.islink(member)):
                return (f"{path}: {member} is not a regular file (a folder or a device), and "
                        f"the run writes its {os.path.basename(member)} there: move it or "
                        f"give another folder")
            problem = file_problem(member)
            if problem:
                return f"{path}: {problem}"
    return None


def _members(folder: str, name: str) -> list:
    """The paths in ``folder`` that ``name`` stands for: itself, or for a pattern the entries
    there it matches."""
    import fnmatch
    if not any(c in name for c in "*?["):
        return [os.path.join(folder, name)]
    entries = os.listdir(folder) if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in sorted(entries) if fnmatch.fnmatch(n, name)]


def refuse_folder(folder: str, names: Iterable[str]) -> None:
    """ConfigError naming what in ``folder`` the run could not write (``folder_problem``)."""
    problem = folder_problem(folder, names)
    if problem:
        from .errors import ConfigError
        raise ConfigError(problem)


def remove_leftovers(folder: str, names: Iterable[str]) -> list:
    """Remove the temporary files (``.NAME.XXXXXXXX.tmp``) of ``names`` (exact, or patterns)
    in ``folder`` that a run killed between a write and its ``os.replace`` left (a kill -9
    skips the clean-up, and they stayed for ever); returns the names removed. Two runs must not
    share a folder: the other's file being written would go too."""
    import fnmatch
    longest_bytes = name_max_bytes(folder)
    removed = []
    for entry in sorted(os.listdir(folder)):
        stem, dot, drawn = entry[:-len(".tmp")].rpartition(".")
        if not (entry.startswith(".") and entry.endswith(".tmp") and dot and len(drawn) == 8):
            continue
        if any(fnmatch.fnmatch(stem[1:], name) or temp_prefix(name, longest_bytes) == stem + "."
               for name in names):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, entry))
            removed.append(entry)
    return removed


class StaleMarker:
    """``STALE.txt`` in ``folder`` while a run rewrites files there (see the module docstring).

    ``names`` are the file names the run owns (exact names; ``*.png``-style patterns too)."""

    def __init__(self, folder: str, names: Iterable[str], run: str) -> None:
        self.folder, self.run = folder, run
        self.patterns = tuple(names)
        self.path = os.path.join(folder, STALE_NAME)
        self.stale: list = []
        self._running = ""

    def begin(self) -> "StaleMarker":
        """Before the run's work: its names are checked (``folder_problem``: ConfigError, the
        folder untouched), the temporary files a killed run left of them are removed
        (``remove_leftovers``), then the marker lists what an earlier run left."""
        refuse_folder(self.folder, self.patterns)
        os.makedirs(self.folder, exist_ok=True)
        remove_leftovers(self.folder, self.patterns)
        self.stale = sorted(n for n in os.listdir(self.folder) if self._owned(n))
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        self._running = f"{self.run} (pid {os.getpid()}) started {started} and has not finished"
        self._note(self._running)
        return self

    def wrote(self, path: str) -> str:
        """Record that ``path`` (in the folder) is now this run's; returns it."""
        name = os.path.basename(path)
        if name in self.stale:
            self.stale.remove(name)
            self._note(self._running)
        return path

    def finish(self, why: Optional[str] = None) -> None:
        """The run ended (``why``: how, when cut short): the marker goes, or keeps what the run
        did not rewrite."""
        if not self.stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        self._note(f"{self.run} ended {time.strftime('%Y-%m-%d %H:%M:%S')}"
                   f"{' (' + why + ')' if why else ''} without rewriting them")

    def failed(self, error: BaseException) -> None:
        """The run ended with ``error`` (not Ctrl-C): the marker says so, not "has not
        finished"; a marker that cannot be written (the disk that failed the run) is let be,
        so that ``error`` is what the run reports."""
        with contextlib.suppress(OSError):
            self.finish(f"it failed: {type(error).__name__}: {error}".replace("\n", " "))

    def _owned(self, name: str) -> bool:
        import fnmatch
        return name != STALE_NAME and any(fnmatch.fnmatch(name, p) for p in self.patterns)

    def _note(self, status: str) -> None:
        if not self.stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        write_text(self.path, f"These files are from an earlier run: {status}.\n"
                              + "".join(f"{name}\n" for name in self.stale))
