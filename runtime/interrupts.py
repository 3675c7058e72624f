"""deferred_interrupts: a Ctrl-C (SIGINT) that lands inside a block is raised after it.

A block that changes two records which must agree (a cache's memory and the planners that
decided it; every tensor-parallel rank's step) cannot be cut between them. Python delivers
KeyboardInterrupt at any bytecode of the main thread; inside the block it is held and raised,
as KeyboardInterrupt, once the block has finished (not when it raised: its own exception goes
on). A second Ctrl-C inside the block raises at once (a hung block must stay stoppable). Only
the main thread receives signals, and only with Python's own SIGINT handler in place is the
handler swapped: elsewhere (another thread, a caller's handler, a block nested in another)
the block runs as is.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred_interrupts(enabled: bool = True) -> Iterator[None]:
    """Hold a Ctrl-C that lands in the block until it ends (see the module docstring)."""
    if not enabled or threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught = []

    def defer(signum, frame):
        if caught:                          # the second: at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        caught.append(signum)
    signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt
