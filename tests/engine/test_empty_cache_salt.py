"""An empty ``cache_salt`` is refused by name, as vLLM and this server's HTTP field refuse it: it
was taken as a salt of its own, so a caller passing "" for "no salt" silently shared nothing
with unsalted requests."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import SamplingParams
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import BeamSearchParamsError, EngineConfigError


@pytest.mark.parametrize("make, error", [
    (lambda salt: SamplingParams(cache_salt=salt), EngineConfigError),
    (lambda salt: BeamSearchParams(beam_width=2, cache_salt=salt), BeamSearchParamsError)])
def test_an_empty_salt_is_refused_and_others_are_kept(make, error):
    with pytest.raises(error, match="cache_salt must be None or a non-empty str"):
        make("")
    assert make("tenant-a").cache_salt == "tenant-a" and make(None).cache_salt is None
