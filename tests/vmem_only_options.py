"""The options a test gives a cache of either kind: a paged cache refuses the vmem-only ones
(``page_bytes``, ``layout``, ``background_mapper``, ...: they would do nothing there;
EngineConfig, make_kv), so they are given only where the cache is vmem."""
from __future__ import annotations

from vmemkv.runtime.kv import VMEM_ONLY_DEFAULTS


def options_for(cache: str, **options) -> dict:
    """``options`` for a ``cache`` ("vmem" or "paged") cache: all of them for vmem, for paged
    those that are not vmem-only."""
    if cache == "vmem":
        return options
    return {name: value for name, value in options.items() if name not in VMEM_ONLY_DEFAULTS}
