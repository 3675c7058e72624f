"""What every ``vmemkv`` subcommand shares: argparse value types and the interrupt test hook.

One parser per kind of value, so a flag means the same thing and takes the same syntax in every
subcommand: sizes (``parse_bytes``: ``65536``, ``64KiB``, ``2 MiB``, ``1GB``), bounded numbers
(``bounded``: finite, inside a named range; ``POSITIVE_INT``, ``NON_NEGATIVE_INT`` and
``POSITIVE_FLOAT`` the common ones) and thread counts (``thread_count``); list flags that take
each value once (``DistinctValues``); and stdout for a reader that may close it early
(``write_stdout``). Each raises
argparse.ArgumentTypeError, so a bad value is one line naming the flag, the value and the limit.
Pure Python (the subcommands of every layer import it; it imports none of them).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import tempfile
import time
from typing import Callable, NamedTuple, Optional, Union

Number = Union[int, float]

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'2097152', '2MiB', '64 KiB', '1GB' -> bytes, a whole number >= 1 (argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: want bytes, or a number with KiB, MiB, GiB, TiB, KB, MB, GB or TB")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be a whole number of bytes >= 1")
    return int(value)


def bounded(kind: type, low: Optional[Number] = None, high: Optional[Number] = None,
            low_open: bool = False, high_open: bool = False) -> Callable[[str], Number]:
    """An argparse type: ``kind`` (int or float) parsed from the text, finite (no inf or nan),
    at least ``low`` (above it when ``low_open``) and at most ``high`` (below it when
    ``high_open``)."""
    name = "an integer" if kind is int else "a number"

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"want {name}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"want a finite number, got {text!r}")
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            raise argparse.ArgumentTypeError(
                f"must be {_range(low, high, low_open, high_open)}, got {text}")
        return value
    parse.__name__ = kind.__name__      # argparse names the type in its own messages
    return parse


def result_file(text: str) -> str:
    """An argparse type for a file a run writes when it ends, checked before it starts (a run
    of minutes ended in a FileExistsError traceback, or timed everything and then could not
    write it): ``file_problem``."""
    problem = file_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def non_empty_name(text: str) -> str:
    """An argparse type for a name that may not be empty (``--trace ""`` read as no trace: the
    generated workload ran, and its config echoed ``"trace": ""``)."""
    if not text:
        raise argparse.ArgumentTypeError("needs a name, got ''")
    return text


def file_problem(path: str) -> Optional[str]:
    """Why no result file can be written at ``path`` (whole, by a temporary file beside it),
    or None: it must be a file name, not a folder or a device, in a folder we may create files
    in (the folders missing above it are created when it is written: each name no longer than
    the file system allows, none a link to a missing folder), on a file system with space
    left; a link is judged by its target (written through: a dangling link is fine when its
    target's folder exists, refused naming it when not). Tried with a real temporary file
    of the writer's shape (``temp_prefix``), removed at once (root may write anywhere
    ``os.access`` says, /proc too)."""
    if path and os.path.isdir(path):
        return f"{path} is a folder: give a file name"
    if not path or os.path.basename(path) in ("", ".", ".."):
        return f"needs a file name, got {path!r}"
    if os.path.exists(path) and not os.path.isfile(path):
        return (f"{path} is not a regular file (a device or a pipe would be replaced): give a "
                f"file name")
    if os.path.islink(path):     # written through to its target (result_files' docstring)
        target = os.path.realpath(path)
        if not os.path.isdir(os.path.dirname(target)):
            return (f"{path} is a link to {target}, whose folder {os.path.dirname(target)} "
                    f"does not exist: create it or give another file name")
        path = target
    missing = [os.path.basename(path)]
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        if os.path.islink(folder):
            return f"{path}: {folder} is a link to a missing folder ({os.readlink(folder)})"
        missing.append(os.path.basename(folder))
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{path}: {folder} is not a folder"
    if _free_blocks(folder) == 0:
        return (f"{path}: the file system of {folder} has no space left (0 bytes free): the "
                f"run's results could not be written")
    longest_bytes = name_max_bytes(folder)
    for name in missing:
        if len(os.fsencode(name)) > longest_bytes:
            return (f"{path}: the name {name[:40]}... is {len(os.fsencode(name))} bytes, this "
                    f"file system allows at most {longest_bytes}")
    try:
        fd, probe = tempfile.mkstemp(prefix=temp_prefix(path, longest_bytes), suffix=".tmp",
                                     dir=folder)
    except OSError as error:
        return f"{path}: cannot write a file in {folder}: {error.strerror}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def _free_blocks(folder: str) -> Optional[int]:
    """Blocks of ``folder``'s file system this process may still fill (root: the reserved
    ones too), None when unknown or not counted (/proc has no blocks: the probe decides). An
    empty probe file fits a full file system."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    if stat.f_blocks == 0:
        return None
    return stat.f_bfree if os.geteuid() == 0 else stat.f_bavail


def name_max_bytes(folder: str) -> int:
    """The longest file name (bytes) the file system of ``folder`` takes (255 when unknown)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


TEMP_EXTRA_BYTES = len(".") + len(".") + 8 + len(".tmp")    # mkstemp draws 8 characters


def temp_prefix(path: str, longest_bytes: int = 255) -> str:
    """The prefix of the temporary file a result is written to before it replaces ``path``:
    ``.NAME.`` (``.NAME.XXXXXXXX.tmp`` with mkstemp's suffix), NAME cut so that the whole
    name fits ``longest_bytes``: any name the file system takes can be written."""
    name = os.fsencode(os.path.basename(path))[:max(1, longest_bytes - TEMP_EXTRA_BYTES)]
    return "." + os.fsdecode(name) + "."


POSITIVE_INT = bounded(int, 1)                     # counts: requests, repeats, tokens, pages
NON_NEGATIVE_INT = bounded(int, 0)                 # seeds, warm-ups, and counts where 0 is off
POSITIVE_FLOAT = bounded(float, 0, low_open=True)  # sizes (GB, MiB), rates, scales


class DistinctValues(argparse.Action):
    """``action=DistinctValues`` on a list flag (``nargs="+"`` or ``"*"``): a value given twice
    (``--batches 1 1``, which would time the same point twice and write duplicate rows) is
    refused while parsing, before anything runs: one line naming the flag and the value
    (``parser.error``, exit 2 with ``OneLineArgumentParser``). Values are compared after the
    flag's type has parsed them (``--page-bytes 4KiB 4096`` is a repeat) and shown with ``str``.
    The flag itself given twice (``--only alloc --only memory``, whose second list replaced the
    first: only memory ran, unsaid) is refused too."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        flag = "/".join(self.option_strings)   # as argparse names it, not as abbreviated
        if getattr(namespace, self.dest, self.default) is not self.default:   # set by a first use
            parser.error(f"argument {flag}: given twice (the second list would replace the "
                         f"first); give every value after one {flag}")
        for index, value in enumerate(values):
            if value in values[:index]:
                parser.error(f"argument {flag}: {value} is given twice; give each value once")
        setattr(namespace, self.dest, values)


class BatchByCtx(NamedTuple):
    """One (batch, context) point of a benchmark grid, shown as typed (``8x2048``) in messages."""
    batch: int
    ctx: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.ctx}"


def batch_by_ctx(text: str) -> BatchByCtx:
    """``8x2048`` -> (8, 2048): the type of a ``BATCHxCTX`` flag; both at least 1."""
    batch, sep, ctx = text.partition("x")
    if not sep or not batch.isdigit() or not ctx.isdigit() or int(batch) < 1 or int(ctx) < 1:
        raise argparse.ArgumentTypeError(f"expected BATCHxCTX such as 8x2048, both >= 1; got {text!r}")
    return BatchByCtx(int(batch), int(ctx))


def _range(low, high, low_open: bool, high_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"{'<' if high_open else '<='} {high}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def max_threads() -> int:
    """The most torch CPU threads a flag accepts: this machine's CPU count."""
    return os.cpu_count() or 1


def thread_count(text: str) -> int:
    """An argparse type for ``--threads``: 1 to this machine's CPU count (more only oversubscribes
    the cores, and torch crashes on very large values)."""
    try:
        return bounded(int, 1, max_threads())(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{error} (this machine has {max_threads()} CPUs)") from None


def write_stdout(text: str) -> bool:
    """Write ``text`` on stdout and flush it; False when the reader has gone (``vmemkv sweep |
    head`` closed the pipe): stdout is pointed at /dev/null so that nothing more, and not
    Python's flush at exit, raises BrokenPipeError; what is left to print is dropped."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return False


HOLD_ENV = "VMEMKV_TEST_HOLD"


def hold_point(name: str, timeout_s: float = 120.0) -> None:
    """Test hook for interrupts: when the environment variable VMEMKV_TEST_HOLD equals ``name``,
    say so on stderr and wait (up to ``timeout_s``) for a signal, so a test can send SIGINT at a
    known point instead of guessing with sleeps. A no-op otherwise."""
    if os.environ.get(HOLD_ENV) != name:
        return
    sys.stderr.write(f"vmemkv: holding at {name} (test hook)\n")
    sys.stderr.flush()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.01)
