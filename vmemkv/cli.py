"""vmemkv: virtual-memory KV caches for LLM inference, beside a PagedAttention layout.

The ``vmemkv`` command line: one subcommand per job, each registered by the module that owns it.
Errors a user can make (a bad flag value, a missing file) exit with status 2 and one line on
stderr, never a traceback (a module of an optional extra that is not installed too: one line
naming the extra, ``missing_extra``); Ctrl-C exits with status 130 and one line, after the subcommand has
released its memory and written what finished. Heavy imports (torch) happen inside the
subcommand that needs them.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

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
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="vmemkv", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"vmemkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=OneLineArgumentParser)
    for name, module_name in SUBCOMMANDS.items():
        importlib.import_module(module_name).register(subparsers)
    return parser


def interrupted_exit(prog: str, interrupt: KeyboardInterrupt) -> int:
    """Ctrl-C as every command ends on it: one line on stderr, ``PROG: interrupted; NOTE`` (the
    note is the interrupt's text, saying what was written), and status 130, no traceback."""
    note = f"; {interrupt}" if str(interrupt) else ""
    sys.stderr.write(f"{prog}: interrupted{note}\n")
    return INTERRUPTED_EXIT


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt as interrupt:   # the subcommand has cleaned up; its note says what it wrote
        return interrupted_exit(f"vmemkv {args.command}", interrupt)
    except UsageError as error:
        sys.stderr.write(f"vmemkv {args.command}: error: {error}\n")
        return 2
    except Exception as error:  # noqa: BLE001 -- re-raised below unless it is the user's to fix
        line = missing_extra(error)
        if line is None and not _users_to_fix(error):
            raise
        sys.stderr.write(f"vmemkv {args.command}: error: "
                         f"{line or f'{type(error).__name__}: {error}'}\n")
        return 2


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


if __name__ == "__main__":
    sys.exit(main())
