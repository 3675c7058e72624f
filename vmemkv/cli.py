"""The ``vmemkv`` command line: one subcommand per job, each registered by the module that owns it.

Errors a user can make (a bad flag value, a missing file) exit with status 2 and one line on
stderr, never a traceback. Heavy imports (torch) happen inside the subcommand that needs them.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# subcommand -> module with register(subparsers) and run(args) -> int
SUBCOMMANDS = {
    "info": "vmemkv.runtime.info",
    "simulate": "vmemkv.scheduler.cli",
    "bench": "vmemkv.bench",
    "generate": "vmemkv.runtime.generate_cli",
}


class UsageError(Exception):
    """A user error on the command line; reported as one line, exit status 2."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line on stderr and exits 2."""

    def error(self, message: str) -> None:  # noqa: D401 (argparse API)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="vmemkv", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True,
                                       parser_class=OneLineArgumentParser)
    for name, module_name in SUBCOMMANDS.items():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return int(module.run(args) or 0)
    except UsageError as error:
        sys.stderr.write(f"vmemkv {args.command}: error: {error}\n")
        return 2
    except Exception as error:  # noqa: BLE001 -- re-raised below unless it is the user's to fix
        if not _users_to_fix(error):
            raise
        sys.stderr.write(f"vmemkv {args.command}: error: {type(error).__name__}: {error}\n")
        return 2


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
