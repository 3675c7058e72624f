"""A tiny progress bar on stderr: tqdm when it is installed (the ``bench`` extra), else our own
one-line bar redrawn at most ten times a second. Disabled bars cost one int compare per update."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    """Counts ``total`` units; ``update(n)`` adds n. Use as a context manager or call close()."""

    def __init__(self, total: int, desc: str = "", enabled: Optional[bool] = None,
                 stream: Optional[TextIO] = None):
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.desc, self.enabled = max(total, 1), desc, enabled
        self.count = 0
        self._last_draw = 0.0
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
                self._tqdm = tqdm(total=total, desc=desc, file=self.stream, leave=False)
            except ImportError:
                pass

    def update(self, n: int = 1) -> None:
        if not self.enabled or n <= 0:
            return
        self.count += n
        if self._tqdm is not None:
            self._tqdm.update(n)
            return
        now = time.monotonic()
        if now - self._last_draw >= 0.1 or self.count >= self.total:
            self._last_draw = now
            self._draw()

    def _draw(self, width: int = 30) -> None:
        frac = min(self.count / self.total, 1.0)
        bar = "#" * int(frac * width)
        self.stream.write(f"\r{self.desc} [{bar:<{width}}] {self.count}/{self.total}")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            self.stream.write("\r" + " " * (len(self.desc) + 50) + "\r")
            self.stream.flush()
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
