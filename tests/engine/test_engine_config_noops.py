"""EngineConfig refuses, by name, an option given where it would do nothing (as `vmemkv
generate` refuses the flag): prefix_eviction without prefix_sharing, a layout with the paged
cache. The same options where they apply are taken."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import EngineConfig, EngineConfigError


@pytest.mark.parametrize("options, named", [
    (dict(prefix_eviction="hits"), "EngineConfig.prefix_eviction 'hits' applies with "
                                   "prefix_sharing=True only"),
    (dict(prefix_eviction="off"), "EngineConfig.prefix_eviction 'off' applies with "
                                  "prefix_sharing=True only"),
    (dict(cache="paged", layout="interleaved"), "EngineConfig.layout 'interleaved' applies to "
                                                "cache='vmem' only"),
    (dict(cache="paged", layout="auto"), "EngineConfig.layout 'auto' applies to cache='vmem'"),
])
def test_an_option_that_would_do_nothing_is_refused_by_name(options, named):
    with pytest.raises(EngineConfigError, match=named.replace("(", r"\(")):
        EngineConfig(**options)


@pytest.mark.parametrize("options", [
    dict(prefix_sharing=True, prefix_eviction="hits"),
    dict(prefix_sharing=True, prefix_eviction="off"),
    dict(cache="paged"), dict(cache="paged", prefix_sharing=True, prefix_eviction="hits"),
    dict(cache="vmem", layout="interleaved"), dict(cache="vmem", layout="auto"),
])
def test_the_same_options_where_they_apply_are_taken(options):
    config = EngineConfig(**options)
    assert all(getattr(config, name) == value for name, value in options.items())
