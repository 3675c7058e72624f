"""Run a function in a forked child of the test process: cheap (torch and the models are
already imported), and a child that crashes (a segfault) fails its test, never the run."""
import os
import select
import time

import torch


def in_child(work, go=None):
    """Fork; the child waits for ``go`` (a pipe's read end) when given, runs ``work()`` with one
    torch thread and reports what it returned (or the error's type) on a pipe, then exits."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:        # the child: never returns into pytest
        try:
            torch.set_num_threads(1)
            if go is not None:
                os.read(go, 1)
            result = repr(work())
        except BaseException as error:   # noqa: BLE001 -- reported to the parent
            result = f"raised {type(error).__name__}: {error}"
        os.write(write_end, result.encode()[:4000])
        os._exit(0)
    os.close(write_end)
    return pid, read_end


def child_result(pid, read_end, timeout_s=60.0) -> str:
    """What the child reported ("" plus the signal when it crashed); the bound only turns a
    hang into a failure."""
    ready, _, _ = select.select([read_end], [], [], timeout_s)
    if not ready:
        os.kill(pid, 9)
    text = os.read(read_end, 4096).decode() if ready else "child hung"
    os.close(read_end)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "child did not exit"
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        text += f" (killed by signal {os.WTERMSIG(status)})"
    return text
