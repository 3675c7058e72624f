"""vmemkv: virtual-memory KV caches for LLM inference, beside a PagedAttention layout.

The ``vmemkv`` command line: one subcommand per job, each registered by the module that owns it.
Errors a user can make (a bad flag value, a missing file, a closed stdout) exit with status 2
and one line on stderr, never a traceback (a module of an optional extra that is not installed too: one line
naming the extra, ``missing_extra``); Ctrl-C exits with status 130 and one line, after the subcommand has
released its memory and written what finished; SIGTERM (``timeout``, systemd, Slurm,
Kubernetes) takes the same way out and exits with status 143 (``SigtermAsInterrupt``). Heavy
imports (torch) happen inside the subcommand that needs them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional, Sequence

from vmemkv import __version__

# subcommand -> module with register(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "info": "vmemkv.runtime.info",
    "simulate": "vmemkv.scheduler.cli",
    "sweep": "vmemkv.scheduler.cli_sweep",
    "calibrate": "vmemkv.runtime.calibrate",
    "bench": "vmemkv.bench",
    "generate": "vmemkv.runtime.generate_cli",
    "serve": "vmemkv.runtime.serve.cli",
}

# commands that print no results (a server's answers go to its clients, its log to stderr):
# a closed stdout (a daemon's >&-) is no reason to refuse them
LOGS_ON_STDERR_ONLY = frozenset({"serve"})

DESCRIPTION = """\
Virtual-memory KV caches for LLM inference, beside a PagedAttention layout: run the engine,
benchmark the two layouts head to head, or study a memory policy in the simulator.
"""

EPILOG = """\
examples (with the project's virtual environment active):
  vmemkv info                                   what this machine offers
  vmemkv bench --quick                          VMM against paged, summary + bench_out/
  echo "1 2 3 4" | vmemkv generate --model tiny-llama --max-new-tokens 8
  vmemkv simulate --requests 500 --cache-gb 20 --policy vmem --gpu h100
  vmemkv sweep docs/examples/sweep.toml --out sweep_out   a grid of simulations in parallel
  vmemkv calibrate --model tiny-llama --out profile.json  a device profile for simulate --profile
  vmemkv serve --model tiny-llama --port 8000   an OpenAI-compatible server ('serve' extra)

'vmemkv COMMAND --help' lists a command's flags with their units and defaults.
"""

INTERRUPTED_EXIT = 130   # 128 + SIGINT, what a shell reports for Ctrl-C
TERMINATED_EXIT = 143    # 128 + SIGTERM, what a shell reports for a job stopped by SIGTERM

# a module an optional extra installs -> the extras to ask for (pyproject.toml's
# [project.optional-dependencies]; GGUF files are read through transformers, hence hf,real)
EXTRA_OF_MODULE = {
    "transformers": "hf", "safetensors": "hf",
    "gguf": "hf,real", "accelerate": "hf,real",
    "matplotlib": "bench", "tqdm": "bench",
    "fastapi": "serve", "uvicorn": "serve", "httpx": "serve",
    "ray": "ray", "cuda": "cuda", "flash_attn": "flash",
}


class UsageError(Exception):
    """A user error on the command line; reported as one line, exit status 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help line ends with its default, unless the line already states it
    (flags whose default is "decided at run time" say what decides it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is d for d in (None, False, argparse.SUPPRESS)) \
                or not action.option_strings:
            return text
        default = action.default
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default)) or "none"
        return f"{text} (default: {default})"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line on stderr and exits 2, and shows every
    flag's default in ``--help``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # noqa: D401 (argparse API)
        write_error_line(f"{self.prog}: error: {message}")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="vmemkv", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"vmemkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=OneLineArgumentParser)
    for name, module_name in SUBCOMMANDS.items():
        importlib.import_module(module_name).register(subparsers)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command (``SigtermAsInterrupt``): it takes Ctrl-C's way out (what
    finished written, memory released), then the command exits with ``TERMINATED_EXIT``."""


class SigtermAsInterrupt:
    """SIGTERM as a command takes it: during ``installed()``, on the main thread (elsewhere no
    signal can be handled: nothing changes), SIGTERM raises ``Terminated``, and ``received``
    remembers that it came (a command that re-raises its own KeyboardInterrupt with a note of
    what it wrote still ends as terminated). The handler that was there before is put back after.
    A process forked meanwhile (a sweep's worker pool) is ended by SIGTERM as before
    (``_default_sigterm_in_child``)."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum, frame) -> None:
        self.received = True
        raise Terminated

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _default_sigterm_in_child() -> None:
    """A forked child runs no command: its parent ends it with SIGTERM (a pool's terminate, a
    worker's parent-death signal), which must kill it, not raise in whatever it computes."""
    if isinstance(signal.getsignal(signal.SIGTERM), SigtermAsInterrupt):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_sigterm_in_child)


def interrupted_exit(prog: str, interrupt: KeyboardInterrupt, terminated: bool) -> int:
    """Ctrl-C as every command ends on it: one line on stderr, ``PROG: interrupted; NOTE`` (the
    note is the interrupt's text, saying what was written), and status 130, no traceback;
    ``terminated`` (SIGTERM came): ``PROG: terminated (SIGTERM); NOTE`` and status 143."""
    note = f"; {interrupt}" if str(interrupt) else ""
    if terminated:
        write_error_line(f"{prog}: terminated (SIGTERM){note}")
        return TERMINATED_EXIT
    write_error_line(f"{prog}: interrupted{note}")
    return INTERRUPTED_EXIT


def write_error_line(line: str) -> None:
    """``line`` and a newline on stderr, each lone surrogate in it written as its escape
    (``\\ud800``): error text quotes what a user or a template gave (a chat template's
    ``raise_exception`` text, a path or flag of non-UTF-8 bytes under a C locale), and a stderr
    whose errors are strict (a wrapper's, an embedding's) raised UnicodeEncodeError, a
    traceback in place of the one line. A closed stderr (2>&-, Python's None) gets nothing."""
    if sys.stderr is None:
        return
    sys.stderr.write(line.encode("utf-8", "backslashreplace").decode("utf-8") + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    sigterm = SigtermAsInterrupt()
    try:   # loading every subcommand's module takes a while: Ctrl-C then is one line too
        with sigterm.installed():
            args = build_parser().parse_args(argv)
    except KeyboardInterrupt as interrupt:
        return interrupted_exit("vmemkv", interrupt, terminated=sigterm.received)
    if sys.stdout is None and args.command in LOGS_ON_STDERR_ONLY:
        sys.stdout = open(os.devnull, "w")   # uvicorn's log setup reads it; nothing is written
    if sys.stdout is None:   # started with stdout closed (>&-): print() drops every result unsaid
        write_error_line(f"vmemkv {args.command}: error: stdout is closed, so the results would "
                         f"be lost: redirect it (> FILE, or > /dev/null to drop them)")
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command])
    return command_status(f"vmemkv {args.command}", lambda: module.run(args))


def command_status(prog: str, body: Callable[[], Optional[int]]) -> int:
    """``body()``'s exit status (None: 0), the command ended as every command ends, with no
    traceback for what is not a bug: Ctrl-C and SIGTERM (``SigtermAsInterrupt``) by
    ``interrupted_exit`` (``body`` has cleaned up; its note says what it wrote), an error the
    user fixes (``user_error_line``) by one line, ``PROG: error: LINE``, and status 2. Any other
    exception is re-raised (a bug keeps its traceback)."""
    sigterm = SigtermAsInterrupt()
    try:
        with sigterm.installed():
            return int(body() or 0)
    except KeyboardInterrupt as interrupt:
        return interrupted_exit(prog, interrupt, terminated=sigterm.received)
    except Exception as error:  # noqa: BLE001 -- re-raised below unless it is the user's to fix
        line = user_error_line(error)
        if line is None:
            raise
        write_error_line(f"{prog}: error: {line}")
        return 2


def user_error_line(error: Exception) -> Optional[str]:
    """The one line that reports ``error`` when the user fixes it by changing the command (a
    ``UsageError``: its text; a missing extra: ``missing_extra``; a typed library error,
    ``_users_to_fix``: ``TYPE: TEXT``, an OSError's naming its path), else None: a bug, whose
    traceback the caller keeps."""
    if isinstance(error, UsageError):
        return str(error)
    line = missing_extra(error)
    if line is None and _users_to_fix(error):
        line = f"{type(error).__name__}: {error}"
    return line


def missing_extra(error: BaseException) -> Optional[str]:
    """``"<module> is not installed: pip install 'vmemkv[<extra>]'"`` when ``error`` is the
    ModuleNotFoundError of a module that an optional extra installs (``EXTRA_OF_MODULE``), else
    None (a module of no extra -- torch, a typo -- is a bug or a broken install, not a hint)."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    module = error.name.partition(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    return None if extra is None else f"{module} is not installed: pip install 'vmemkv[{extra}]'"


def _users_to_fix(error: Exception) -> bool:
    """Typed library errors a user fixes by changing the command (ConfigError,
    RequestTooLargeError, a backend or driver that cannot run here, ...): one line, no
    traceback. Their modules are loaded if they were raised, so the check imports nothing."""
    if isinstance(error, (ValueError, KeyError, OSError, MemoryError)):
        return True
    bases = [getattr(sys.modules.get(module), name, None) for module, name in
             (("vmemkv.runtime.attention.errors", "AttentionError"), ("vmemkv.vmem.errors", "VMemError"))]
    return any(base is not None and isinstance(error, base) for base in bases)


if __name__ == "__main__":   # python -m vmemkv.cli: the imported module's main, whose UsageError is
    sys.exit(importlib.import_module("vmemkv.cli").main())   # the one subcommands raise
