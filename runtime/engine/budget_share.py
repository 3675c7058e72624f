"""An engine's share of a MemoryBudget (scheduler/budget.py), checked before anything is
built: its bounds against the engine's cache bytes and the device's total memory."""
from __future__ import annotations

from vmemkv.runtime import memory


def budget_share_for(budget, cfg, cache_bytes: int, name: str, register: bool = True,
                     device=None):
    """The engine's share of ``budget`` (None without one): ``cache_bytes`` held now,
    ``min_cache_bytes`` (default: those) reserved, up to ``max_cache_bytes`` (default: the
    budget's total). EngineConfigError when the budget cannot hold it, when
    ``min_cache_bytes`` is above ``cache_bytes`` or the max, or given without a budget.
    ``register=False``: only the checks (before anything is built); returns None. ``device``:
    the cache's, whose total memory the budget's total may not exceed."""
    from .errors import EngineConfigError
    low = cache_bytes if cfg.min_cache_bytes is None else cfg.min_cache_bytes
    if budget is None:
        if cfg.min_cache_bytes is not None:
            raise EngineConfigError(f"min_cache_bytes={cfg.min_cache_bytes} needs a "
                                    f"memory_budget (the bytes it reserves are the budget's)")
        return None
    from vmemkv.scheduler.budget import MemoryBudget
    from vmemkv.scheduler.errors import ConfigError
    if not isinstance(budget, MemoryBudget):
        raise EngineConfigError(f"memory_budget must be a MemoryBudget, got {type(budget).__name__}")
    if cfg.cache != "vmem":
        raise EngineConfigError(f"a MemoryBudget needs cache='vmem' (only its pool resizes), "
                                f"got {cfg.cache!r}")
    high = budget.total_bytes if cfg.max_cache_bytes is None else cfg.max_cache_bytes
    named = f"min_cache_bytes ({low})" if cfg.min_cache_bytes is not None else \
        f"cache_bytes ({cache_bytes}, the default min_cache_bytes)"   # it named a min not given
    for what, limit in ((f"cache_bytes ({cache_bytes})", cache_bytes),
                        (f"the share's max ({high}: max_cache_bytes, else the budget's total)",
                         high)):
        if low > limit:
            raise EngineConfigError(f"{named} is above {what}: the engine "
                                    f"starts at cache_bytes and may hold no more than its max")
    if device is not None:
        _check_budget_fits_device(budget.total_bytes, device)
    if not register:
        return None
    try:
        return budget.register(name, low, high, cache_bytes)
    except ConfigError as error:
        raise EngineConfigError(f"memory_budget: {error}") from None


def _check_budget_fits_device(total_bytes: int, device) -> None:
    """EngineConfigError when the budget's ``total_bytes`` (one device's memory, and a share's
    max by default) exceeds ``device``'s total memory: no engine may be promised memory the
    device does not have. Checked before anything is built."""
    from .errors import EngineConfigError
    device_bytes = memory.device_memory_bytes(device)
    if device_bytes is None or total_bytes <= device_bytes:
        return
    where = "host MemTotal" if device.type == "cpu" else f"{device} total memory"
    raise EngineConfigError(f"memory_budget: its total_bytes ({total_bytes}) exceeds the "
                            f"{where} ({device_bytes} bytes); give the MemoryBudget at "
                            f"most the memory of the device its engines share")
