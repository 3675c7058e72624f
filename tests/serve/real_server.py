"""A real ``vmemkv serve`` subprocess on a free 127.0.0.1 port (``--port 0``: it prints the port
it bound), its stderr collected line by line, and raw-socket helpers for clients that
misbehave. Every wait is bounded: the bound turns a hang into a failure, it is no timing check."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional

from ..signals import sigint_as_ctrl_c

STARTED = re.compile(r"^vmemkv serve: .* http://127\.0\.0\.1:(\d+) ")


class RealServer:
    """``vmemkv serve ARGS --port 0`` until ``stop``; ``url``, ``lines`` (its stderr so far)."""

    def __init__(self, args: List[str], env: Optional[dict] = None, timeout_s: float = 120.0) -> None:
        command = [sys.executable, "-m", "vmemkv.cli", "serve", "--host", "127.0.0.1",
                   "--port", "0", *args]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=sigint_as_ctrl_c)
        self.lines: List[str] = []
        self._port: Optional[int] = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout_s) or self._port is None:
            self.stop()
            raise AssertionError("vmemkv serve never said where it listens:\n" + "".join(self.lines))
        self.url = f"http://127.0.0.1:{self._port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            match = STARTED.match(line)
            if match:
                self._port = int(match.group(1))
                self._ready.set()
        self._ready.set()

    @property
    def port(self) -> int:
        return self._port

    def log_since(self, mark: int) -> str:
        return "".join(self.lines[mark:])

    def wait_for_log(self, pattern: str, mark: int = 0, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_since(mark)
            if re.search(pattern, text):
                return text
            time.sleep(0.02)
        raise AssertionError(f"no log line matching {pattern!r}:\n{self.log_since(mark)}")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def raw_connection(port: int, data: bytes = b"", timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (the socket's timeout bounds the wait)."""
    chunks = []
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        sock.close()
    return b"".join(chunks)
