"""``vmemkv serve`` started with stdout closed (``>&-``, as a daemon often is) serves: it prints
no results (answers go to clients, its log to stderr), yet it was refused with "stdout is
closed, so the results would be lost" and status 2, like the commands that print results."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading

from . import local_http
from .real_server import STARTED


def test_serve_with_stdout_closed_answers_and_stops_on_sigterm():
    command = (f"exec {sys.executable} -m vmemkv.cli serve --host 127.0.0.1 --port 0 "
               f"--model tiny-llama >&-")
    proc = subprocess.Popen(["bash", "-c", command], stderr=subprocess.PIPE, text=True)
    lines, ready, port = [], threading.Event(), []

    def read():
        for line in proc.stderr:
            lines.append(line)
            match = STARTED.match(line)
            if match:
                port.append(int(match.group(1)))
                ready.set()
        ready.set()
    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120) and port, "".join(lines)
        response = local_http.post(f"http://127.0.0.1:{port[0]}/v1/completions",
                                   json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["token_ids"]) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, "".join(lines)          # a drained stop, as with stdout open
    assert "stdout is closed" not in "".join(lines)
