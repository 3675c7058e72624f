"""Subprocess helpers for the Ctrl-C tests."""
import signal


def sigint_as_ctrl_c() -> None:
    """``preexec_fn`` for a child that a test interrupts with SIGINT: the default disposition,
    so Python installs its KeyboardInterrupt handler even when the test runner itself was
    started in the background (a non-interactive shell's ``cmd &`` ignores SIGINT, the child
    inherits that, and Python then leaves it ignored: the child would never see the signal)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
