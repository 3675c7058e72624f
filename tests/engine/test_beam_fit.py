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
    # the hybrid's per-layer pool holds one 12-page group at 64 KiB: no search of 2 beams fits
    assert accepted > 0 or (family, layout) == ("tiny-gemma3", "per-layer")
    # Llama's vmem page groups (16-32 tokens, 128 on fp8) are large enough to refuse some
    assert refused > 0 or family != "tiny-llama" or layout == "paged"


def test_a_search_that_runs_to_max_tokens_is_checked_at_its_last_length():
    """Without stop ids a search runs to max_tokens: 4 beams over 12 tokens on 8-token blocks
    fit a 48-token cache at their first decode (one shared block, a block each: 40) but not at
    their last (31 tokens: three shared blocks, a block each: 56). With a stop id the search
    may end early, so only the first decode step is checked."""
    with Engine(model("tiny-llama"), max_batch=8, max_context=128, cache_bytes=24 * 1024,
                **LAYOUTS["paged"]) as engine:
        assert engine.scheduler.total_tokens == 48
        prompt = list(range(3, 15))
        with pytest.raises(RequestRejectedError, match="holds at least 56 tokens at 31 tokens "
                                                      r"\(it runs to max_tokens 20\)"):
            engine.add_beam_request(prompt, BeamSearchParams(4, max_new_tokens=20, ignore_eos=True))
        assert not engine.has_unfinished()
        rid = engine.add_beam_request(prompt, BeamSearchParams(4, max_new_tokens=20, ignore_eos=True,
                                                               stop_token_ids=(255,)))
        engine.run_until_done()
        assert engine.output(rid, pop=True).status in ("finished", "failed")


def test_a_prompt_past_the_window_is_checked_by_the_units_the_window_reads():
    """Mistral's 32-token window on fp8 page groups of 128 tokens: 2 beams over a 33-token
    prompt each need a group of their own, 256 tokens, in a 128-token cache. The check skipped
    prompts past the window and the search failed after its prefill."""
    with Engine(model("tiny-mistral-swa"), max_batch=8, max_context=128, cache_bytes=24 * 1024,
                kv_cache_dtype="fp8_e4m3", **LAYOUTS["per-layer"]) as engine:
        assert engine.scheduler.total_tokens == 128 and engine.kv.manager.window_tokens == 32
        with pytest.raises(RequestRejectedError, match="holds at least 256 tokens at its first "
                                                      "decode step.*that the window reads"):
            engine.add_beam_request(list(range(3, 36)), BeamSearchParams(2, max_new_tokens=2))
        rid = engine.add_beam_request(list(range(3, 36)), BeamSearchParams(1, max_new_tokens=4))
        engine.run_until_done()
        assert engine.output(rid, pop=True).status == "finished"


@pytest.mark.parametrize("layout", ["per-layer", "paged"])
def test_a_hybrid_pool_with_fewer_units_than_beams_refuses_the_search(layout):
    """Gemma 3 (five windowed layers, one full): each beam writes its newest token into every
    layer, so each holds a unit of every kind of its own: a 12-page group on 4 KiB per-layer
    pages (the 48 KiB pool holds one), a block of each of the six block groups on paged. The
    hybrid was never checked, and such searches failed after their prefill."""
    options = dict(LAYOUTS[layout], cache_bytes=48 * 1024 if layout == "per-layer" else 24 * 1024)
    with Engine(model("tiny-gemma3"), max_batch=8, max_context=128, **options) as engine:
        layout_value = engine.kv.manager.layout()
        per_beam, pool = ((12, 12) if layout == "per-layer" else
                          (len(layout_value.block_groups), layout_value.num_blocks))
        too_many = pool // per_beam + 1
        with pytest.raises(RequestRejectedError, match=f"{too_many} beams holds at least "
                                                      f"{too_many * per_beam} "):
            engine.add_beam_request([3, 4, 5], BeamSearchParams(too_many, max_new_tokens=4))
        assert not engine.has_unfinished()
        rid = engine.add_beam_request([3, 4, 5], BeamSearchParams(pool // per_beam,
                                                                  max_new_tokens=2))
        engine.run_until_done()
        assert engine.output(rid, pop=True).status in ("finished", "failed")
