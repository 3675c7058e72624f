"""A MemoryBudget's inputs (scheduler/budget.py), each refused by name (ConfigError) before
anything changes: the budget's total, idle delay, grow fraction and clock; a share's name and
byte bounds."""
from __future__ import annotations

from .errors import ConfigError
from .field_checks import check_int


def check_budget(total_bytes, idle_release_s, grow_fraction, clock) -> None:
    """``MemoryBudget(...)``'s arguments: ``clock`` is called at every ``decide``."""
    check_int("MemoryBudget total_bytes", total_bytes, 1)
    if isinstance(idle_release_s, bool) or not isinstance(idle_release_s, (int, float)) \
            or not 0 <= idle_release_s < 1e9:
        raise ConfigError(f"idle_release_s must be seconds in [0, 1e9), got {idle_release_s!r}")
    if isinstance(grow_fraction, bool) or not isinstance(grow_fraction, (int, float)) \
            or not 0 <= grow_fraction <= 1:
        raise ConfigError(f"grow_fraction must be in [0, 1], got {grow_fraction!r}")
    if not callable(clock):
        raise ConfigError(f"MemoryBudget clock must be a function returning seconds, got "
                          f"{clock!r}")


def check_share(name, min_bytes: int, max_bytes: int, initial_bytes: int) -> None:
    """``register``'s arguments: a share's name is a non-empty str (pressure on equally spare
    shares goes by name, so names are compared: an int beside a str was a TypeError inside
    ``decide``, the share stamped and left blocked), its bytes ints with min <= initial <= max."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a MemoryBudget share's name must be a non-empty str, got {name!r}")
    for field, value, low in (("min_bytes", min_bytes, 0), ("max_bytes", max_bytes, 1),
                              ("initial_bytes", initial_bytes, 0)):
        check_int(field, value, low)
    if not min_bytes <= initial_bytes <= max_bytes:
        raise ConfigError(f"share {name!r}: needs min_bytes <= initial_bytes <= max_bytes, "
                          f"got {min_bytes}, {initial_bytes}, {max_bytes}")
