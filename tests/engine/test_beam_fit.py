"""The add-time check of a beam search's memory (``Scheduler._check_beam_group_fits``) refuses
only groups that could never run: whatever it refuses, run with the check switched off, fails
with the cache to itself. Over families (one kind; the Gemma 3 hybrid, whose interleaved pages
straddle tokens; a sliding window), layouts, cache sizes and K/V dtypes."""
from __future__ import annotations

import itertools

import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.scheduler.beam_groups import BeamGroups
from vmemkv.scheduler.errors import ConfigError

from .conftest import model

LAYOUTS = {"per-layer": dict(cache="vmem", layout="per-layer", page_bytes=4096),
           "interleaved": dict(cache="vmem", layout="interleaved", page_bytes=4096),
           "paged": dict(cache="paged", block_size=8)}
SHAPES = list(itertools.product([5, 20, 33], [2, 4], [2, 8]))   # prompt, beams, new tokens


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gemma3", "tiny-mistral-swa"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_refused_beam_search_fails_alone_without_the_check(family, layout, monkeypatch):
    refused = accepted = 0
    for cache_kib, dtype in itertools.product([32, 64], ["auto", "fp8_e4m3"]):
        try:
            engine = Engine(model(family), max_batch=8, max_context=128,
                            cache_bytes=cache_kib * 1024, kv_cache_dtype=dtype, **LAYOUTS[layout])
        except ConfigError:      # no page group fits (the hybrid's per-layer groups at 32 KiB)
            continue
        with engine:
            fits = engine.scheduler.max_fit_tokens
            for prompt_len, width, new in [s for s in SHAPES if s[0] + s[2] <= fits]:
                params = BeamSearchParams(width, max_new_tokens=new, ignore_eos=True)
                prompt = list(range(3, 3 + prompt_len))
                try:
                    rid = engine.add_beam_request(prompt, params)
                except RequestRejectedError:
                    refused += 1
                    with monkeypatch.context() as patch:
                        patch.setattr(BeamGroups, "_check_beam_group_fits", lambda self, r: None)
                        rid = engine.add_beam_request(prompt, params)
                        engine.run_until_done()
                    out = engine.output(rid, pop=True)
                    assert out.status == "failed", (cache_kib, dtype, prompt_len, width, new)
                    assert "cannot grow" in out.error.message
                    continue
                accepted += 1
                engine.run_until_done()
                engine.output(rid, pop=True)
    assert accepted > 0
    # Llama's vmem page groups (16-32 tokens, 128 on fp8) are large enough to refuse some
    assert refused > 0 or family != "tiny-llama" or layout == "paged"
