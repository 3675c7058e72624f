"""The per-user cache folder that vmemkv writes what it builds once per machine into: the
native kernels' builds (``runtime/attention/native.py``) and the GGUF conversions
(``runtime/gguf.py``, under ``gguf/``).

It is ``$VMEMKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/vmemkv``, else ``~/.cache/vmemkv``: one
setting moves both. Where it cannot be written, each user's error names the folder and
``$VMEMKV_CACHE_DIR`` (``unusable_cache``).
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VARIABLE = "VMEMKV_CACHE_DIR"


def cache_root() -> Path:
    """``$VMEMKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/vmemkv``, else ``~/.cache/vmemkv`` (an
    empty variable counts as unset); neither created nor checked here."""
    if os.environ.get(CACHE_DIR_VARIABLE):
        return Path(os.environ[CACHE_DIR_VARIABLE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vmemkv"


def unusable_cache(what: str, folder: Path, error: OSError) -> str:
    """The message for ``what`` (e.g. "the GGUF cache") at ``folder`` that failed with
    ``error``: the folder, why, and the setting that moves it."""
    setting = os.environ.get(CACHE_DIR_VARIABLE) or "unset"
    return (f"{what} {folder} cannot be used ({error.strerror or error}): set "
            f"${CACHE_DIR_VARIABLE} (now {setting}) to a writable folder")
