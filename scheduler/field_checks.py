"""Checks of one config field's type and range, shared by the simulator's frozen specs
(``WorkloadSpec``, ``LoraSpec``, ``SimConfig``, ``CostModel``): a bool is never a number, a
number is finite, and a bad value is a ``ConfigError`` naming the field, the value and the
allowed range."""
from __future__ import annotations

import math
import os
from typing import Optional

from .errors import ConfigError


def check_int(field: str, value, minimum: int) -> None:
    """``value`` is an int (not a bool) >= ``minimum``; ``field`` names it ("WorkloadSpec.seed")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{field} must be an int >= {minimum}, got {value!r}")


def check_number(field: str, value, minimum: float = 0.0, unit: str = "",
                 inclusive: bool = True) -> None:
    """``value`` is a finite int or float (not a bool) >= ``minimum`` (> when not
    ``inclusive``), in ``unit`` (shown in the message: "seconds", "bytes")."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and -math.inf < value < math.inf   # not isfinite: an int past a float's range raises
          and (value >= minimum if inclusive else value > minimum))
    if not ok:
        shown = f" of {unit}" if unit else ""
        raise ConfigError(f"{field} must be a finite number{shown} {'>=' if inclusive else '>'} "
                          f"{minimum:g}, got {value!r}")


def check_fraction_or_none(field: str, value) -> None:
    """``value`` is None (off) or a number in (0, 1] (a share of a peak: prefill_mfu)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value <= 1):
        raise ConfigError(f"{field} must be None or a number in (0, 1], got {value!r}")


def check_seed(owner: str, value) -> None:
    """A seed names one workload on every machine: an int >= 0 (None would draw fresh OS
    entropy, a different workload on every call)."""
    check_int(f"{owner}.seed", value, 0)


def file_name(value) -> Optional[str]:
    """``value`` as a file name: a str, or the one an os.PathLike names; None for anything else
    (an int, which open() takes as a file descriptor: it read and closed the caller's)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return value if isinstance(value, str) else None
