"""A sweep's rows as they finish: ``OUT/sweep.rows.jsonl``, one JSON row a line, appended and
flushed to disk as each point finishes, so a Ctrl-C, a failing point or a kill keeps every row
that finished, and ``vmemkv sweep --resume`` runs only the points still missing.

Rows keep their types (the CSV would not), as strict JSON: a figure that is not finite (the TPOT of
requests with one output token is NaN) is null, as in ``simulate --json`` (it was a bare ``NaN``,
which JSON readers other than Python's refuse). A resumed sweep keeps the journal's finished rows
of points that are in its grid (a row is matched to its point by every parameter and, for a trace
file or a custom policy (``file.py:Class``, or ``module:Class``'s module file), its resolved path
and the sha256 of its bytes: ``point_key``; a trace or policy that changed runs again), drops rows
with an error (those points run again), a last line a kill cut short and a row no point can
match (a value no spec gives, ``_key_of``), rewrites the journal with
what it kept (atomically) and appends from there. A sweep without ``--resume`` starts a new
journal.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from .cli_table import to_json
from .errors import ConfigError
from .result_files import atomic_open, refuse_folder, remove_leftovers
from .sweep_spec import PARAMS, point_key

JOURNAL_NAME = "sweep.rows.jsonl"


class RowJournal:
    """The journal in ``out_dir``; ``kept`` are the rows a resume keeps (point key -> row)."""

    def __init__(self, out_dir: str, points: List[dict], resume: bool) -> None:
        self.path = os.path.join(out_dir, JOURNAL_NAME)
        wanted = {point_key(p) for p in points}
        self.kept: Dict[str, dict] = {}
        refuse_folder(out_dir, [JOURNAL_NAME])     # before any point runs
        if os.path.isdir(out_dir):
            remove_leftovers(out_dir, [JOURNAL_NAME])  # a killed rewrite's temporary file
        if resume:
            for row in _read_rows(self.path):
                key = _key_of(row)
                if key in wanted and not row.get("error"):
                    self.kept[key] = row
        with atomic_open(self.path, "w", encoding="utf-8") as f:
            for row in self.kept.values():
                f.write(to_json(row) + "\n")
        self._file = open(self.path, "a", encoding="utf-8")

    @staticmethod
    def journaled(row: dict) -> dict:
        """``row`` as its journal line reads back (a figure that is not finite is None): the
        table's copy of a fresh row, so a sweep's table is the one ``--resume`` writes from
        the journal (a NaN figure was ``nan`` in a fresh run's CSV, empty in a resumed one's)."""
        return json.loads(to_json(row))

    def append(self, row: dict) -> None:
        """One finished row, on disk before this returns (an OSError: ``_failed``)."""
        try:
            self._file.write(to_json(row) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:
            raise self._failed(error) from error

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as error:
            raise self._failed(error) from error

    def _failed(self, error: OSError) -> OSError:
        """A write of the journal that failed (ENOSPC, EFBIG: no file name) as an OSError
        naming it, and what still holds: its whole rows, which ``--resume`` keeps."""
        return OSError(error.errno, f"{error.strerror} (writing the sweep's journal; its "
                                    f"whole rows are kept: --resume runs the rest)", self.path)

    def __enter__(self) -> "RowJournal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key_of(row: dict) -> Optional[str]:
    """The ``point_key`` of a journal row; None for one no point can match: a parameter
    missing, or a value no spec gives (a ``page_bytes`` that is no size ended the resume
    with a ConfigError that named no file: a line not whole is left out the same way)."""
    if not all(k in row for k in PARAMS):
        return None
    try:
        return point_key(row)
    except ConfigError:
        return None


def _read_rows(path: str) -> List[dict]:
    """The journal's rows; lines that are not whole JSON objects (a kill mid-line) are left out."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
