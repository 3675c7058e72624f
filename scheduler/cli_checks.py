"""``vmemkv simulate``'s checks of its flags together, run before a workload is drawn or run.

Each refuses, with a ConfigError naming the flags (one line, exit 2), what would otherwise run
and be silently wrong or fail late: flags that do not apply together, a Poisson rate too low
for the float clock, a ``--write-trace`` path that cannot be written, LoRA budgets that leave no
KV memory. The deployment's own check (``sim_config.check_deployment``) is shared with the sweep.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

from .errors import ConfigError
from .sim_config import check_deployment
from .workload import MAX_ARRIVAL_S


def flag(key: str) -> str:
    """A setting's flag: ``cache_gb`` -> ``--cache-gb``."""
    return "--" + key.replace("_", "-")


def check_flags(args) -> None:
    """Every check below, in the order the user would fix them."""
    check_lora(args)
    check_deployment(model=args.model_preset, gpu=args.gpu, cache_gb=args.cache_gb,
                     preemption=args.preemption, swap_gb=args.swap_gb, policy=args.policy,
                     block_size=args.block_size, max_len=args.max_len, profile=args.profile,
                     name=flag)
    check_together(args)
    check_arrival_rate(args)
    if args.write_trace is not None:
        check_writable(args.write_trace, "--write-trace")


def check_lora(args) -> None:
    """--lora-budget-gb needs adapters and must leave KV memory in --cache-gb."""
    if args.lora_budget_gb is None:
        return
    if not args.lora_adapters:
        raise ConfigError("--lora-budget-gb splits the cache between adapters and KV: give "
                          "--lora-adapters N > 0")
    if args.lora_budget_gb >= args.cache_gb:
        raise ConfigError(f"--lora-budget-gb {args.lora_budget_gb:g} leaves no KV memory in "
                          f"--cache-gb {args.cache_gb:g}: give less than it")


def check_together(args) -> None:
    """Flags that do not apply to what the others ask for."""
    if args.find_max_rate:
        ignored = [name for name, given in (("--seeds", args.seeds is not None),
                                            ("--write-trace", args.write_trace is not None),
                                            ("--goodput", args.goodput is not None)) if given]
        if ignored:
            raise ConfigError(f"{' and '.join(ignored)} do not apply to --find-max-rate (it "
                              f"runs one seed at loads it picks and reports the highest meeting "
                              f"--slo): run them without --find-max-rate, at the load it finds")
    if args.trace and args.seeds:
        raise ConfigError("--seeds draws generated workloads; a --trace replays one fixed workload")
    if not args.trace and (args.rate_scale != 1.0 or args.max_requests is not None):
        raise ConfigError("--rate-scale and --max-requests apply to --trace; for a generated "
                          "workload use --arrival-rate and --requests")


def check_arrival_rate(args) -> None:
    """A Poisson rate so low that the last arrival passes ``MAX_ARRIVAL_S``, where the float
    clock can no longer tell a step's milliseconds apart (5e-324 made every gap infinite)."""
    rate, n = args.arrival_rate, args.requests
    if args.trace or rate == 0 or n <= MAX_ARRIVAL_S * rate:
        return
    raise ConfigError(f"--arrival-rate {rate:g} requests/s puts --requests {n:,} past "
                      f"{MAX_ARRIVAL_S:.0e} s (317 years) of simulated time, where the float clock "
                      f"loses a step's milliseconds: give --arrival-rate >= {n / MAX_ARRIVAL_S:.3g} "
                      f"(or 0: all at time 0)")


def check_writable(path: str, name: str) -> None:
    """ConfigError naming ``name`` unless a result file can be written at ``path`` (whole, by
    a temporary file beside it): a file name, not a folder or a device, in a folder we may
    create files in. Tried with a real temporary file, removed at once."""
    if path and os.path.isdir(path):
        raise ConfigError(f"{name} {path} is a folder: give a file name")
    if not path or os.path.basename(path) in ("", ".", ".."):
        raise ConfigError(f"{name} needs a file name, got {path!r}")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"{name} {path} is not a regular file (a device or a pipe would be "
                          f"replaced): give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)      # the folders are created when it is written
    if not os.path.isdir(folder):
        raise ConfigError(f"{name} {path}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".vmemkv-write-check.", dir=folder)
    except OSError as error:
        raise ConfigError(f"{name} {path}: cannot write a file in {folder}: "
                          f"{error.strerror}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
