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
    fit a 6-block cache at their first decode (one shared block, a block each: 5) but not at
    their last (31 tokens: three shared blocks, a block each: 7). With a stop id the search
    may end early, so only the first decode step is checked."""
    with Engine(model("tiny-llama"), max_batch=8, max_context=128, cache_bytes=24 * 1024,
                **LAYOUTS["paged"]) as engine:
        assert engine.scheduler.total_tokens == 48
        prompt = list(range(3, 15))
        with pytest.raises(RequestRejectedError, match="holds at least 7 blocks at 31 tokens "
                                                      r"\(it runs to max_tokens 20\)"):
            engine.add_beam_request(prompt, BeamSearchParams(4, max_new_tokens=20, ignore_eos=True))
        assert not engine.has_unfinished()
        rid = engine.add_beam_request(prompt, BeamSearchParams(4, max_new_tokens=20, ignore_eos=True,
                                                               stop_token_ids=(255,)))
        engine.run_until_done()
        assert engine.output(rid, pop=True).status in ("finished", "failed")


def test_a_prompt_past_the_window_is_checked_by_the_units_the_window_reads():
    """Mistral's 32-token window on fp8 page groups of 128 tokens: 2 beams over a 33-token
    prompt each need a group of their own (4 pages each) in a 4-page cache. The check skipped
    prompts past the window and the search failed after its prefill."""
    with Engine(model("tiny-mistral-swa"), max_batch=8, max_context=128, cache_bytes=24 * 1024,
                kv_cache_dtype="fp8_e4m3", **LAYOUTS["per-layer"]) as engine:
        assert engine.scheduler.total_tokens == 128 and engine.kv.manager.window_tokens == 32
        with pytest.raises(RequestRejectedError, match="holds at least 8 pages at its first "
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
        with pytest.raises(RequestRejectedError, match=f"{too_many} beams over a 3-token prompt "
                                                      f"holds at least {too_many * per_beam} "):
            engine.add_beam_request([3, 4, 5], BeamSearchParams(too_many, max_new_tokens=4))
        assert not engine.has_unfinished()
        rid = engine.add_beam_request([3, 4, 5], BeamSearchParams(pool // per_beam,
                                                                  max_new_tokens=2))
        engine.run_until_done()
        assert engine.output(rid, pop=True).status in ("finished", "failed")


def _fails_without_the_check(engine, prompt, params, monkeypatch) -> str:
    with monkeypatch.context() as patch:
        patch.setattr(BeamGroups, "_check_beam_group_fits", lambda self, r: None)
        rid = engine.add_beam_request(prompt, params)
        engine.run_until_done()
    out = engine.output(rid, pop=True)
    return out.status == "failed" and "cannot grow" in out.error.message


def test_units_that_straddle_pages_are_counted_by_the_pages_their_bytes_need(monkeypatch):
    """Gemma 3 on 4 KiB interleaved pages: a token of its six layers' K is 768 bytes, so a page
    group spans 3 pages of K and 3 of V and holds 16 tokens, and a partial group is backed only
    by the pages its tokens' bytes cover. 2 beams over 18 tokens hold at their first decode the
    whole first group (6 pages) and a copy each of the second one's 3 tokens (a page of K and
    one of V: 4 pages), 10 pages in an 8-page pool. Such searches were not checked and failed
    after their prefill (215 of one sweep's 632 searches on this layout)."""
    with Engine(model("tiny-gemma3"), max_batch=8, max_context=128, cache_bytes=32 * 1024,
                **LAYOUTS["interleaved"]) as engine:
        layout = engine.kv.manager.layout()
        geometry = layout.geometry
        assert (layout.backing.value, layout.pool_pages, geometry.pages_per_member,
                geometry.tokens_per_page) == ("bytes", 8, 3, 16)
        params = BeamSearchParams(2, max_new_tokens=2, ignore_eos=True)
        with pytest.raises(RequestRejectedError, match="holds at least 10 pages at its first "
                                                      "decode step.*than the cache's 8 pages"):
            engine.add_beam_request(list(range(3, 21)), params)
        assert _fails_without_the_check(engine, list(range(3, 21)), params, monkeypatch)
        # 2 beams over 5 tokens: a copy each of the first group's 6 tokens, 2 pages of K and
        # of V: 8 pages, the whole pool; it runs
        rid = engine.add_beam_request(list(range(3, 8)), params)
        engine.run_until_done()
        assert engine.output(rid, pop=True).status == "finished"


def test_a_hybrids_shared_units_count_in_every_block_group(monkeypatch):
    """Gemma 3 on paged blocks of 8 tokens: six block groups (one full layer, five windowed
    ones) over a 16-block pool. 2 beams over 9 tokens hold in each group the shared first block
    and a block each: 18 blocks. The check counted only the beams' own blocks (12)."""
    with Engine(model("tiny-gemma3"), max_batch=8, max_context=128, cache_bytes=32 * 1024,
                **LAYOUTS["paged"]) as engine:
        assert engine.kv.manager.layout().num_blocks == 16
        params = BeamSearchParams(2, max_new_tokens=2, ignore_eos=True)
        with pytest.raises(RequestRejectedError, match="holds at least 18 blocks at its first "
                                                      "decode step: in each of its 6 block groups"):
            engine.add_beam_request(list(range(3, 12)), params)
        assert _fails_without_the_check(engine, list(range(3, 12)), params, monkeypatch)


@pytest.mark.parametrize("layout, width", [("interleaved", 2), ("paged", 3)])
def test_the_window_gives_memory_back_before_a_beam_copies_its_partial_unit(layout, width):
    """Mistral's 32-token window, a 50-token prompt: its prefill fills four of the four 16-token
    page groups, or seven of the eight 8-token blocks. At the first decode every beam but the
    first copies the partial unit, and the units behind the window make room for those copies
    (one group; two blocks). The window was slid beam by beam, after the first beam's append
    wanted a copy, so the search failed; now every decode slides first, and the tokens equal a
    run on an ample cache."""
    prompt = list(range(3, 53))
    params = BeamSearchParams(width, max_new_tokens=2, ignore_eos=True)
    tokens = {}
    for cache_kib in (32, 256):
        with Engine(model("tiny-mistral-swa"), max_batch=8, max_context=128,
                    cache_bytes=cache_kib * 1024, **LAYOUTS[layout]) as engine:
            rid = engine.add_beam_request(prompt, params)
            engine.run_until_done()
            out = engine.output(rid, pop=True)
            assert out.status == "finished", out.error
            tokens[cache_kib] = [o.token_ids for o in out.outputs]
    assert tokens[32] == tokens[256]


@pytest.mark.parametrize("family, layout", [
    ("tiny-llama", "per-layer"), ("tiny-gemma3", "interleaved"), ("tiny-gemma3", "paged"),
    ("tiny-mistral-swa", "paged")])
def test_the_longest_search_the_check_accepts_is_beam_fit_tokens(family, layout):
    """``Scheduler.beam_fit_tokens`` (the server's limit for a beam search) is the check's own
    bound: prompt + max_tokens at it is accepted, one more refused, per width and stop rule."""
    with Engine(model(family), max_batch=8, max_context=128, cache_bytes=24 * 1024,
                **LAYOUTS[layout]) as engine:
        below_full = 0
        for prompt_len, width, runs in itertools.product([3, 20], [2, 3, 4], [True, False]):
            prompt, stops = list(range(3, 3 + prompt_len)), () if runs else (255,)
            limit = engine.scheduler.beam_fit_tokens(prompt_len, width, runs)
            below_full += limit < engine.scheduler.max_fit_tokens
            for final, accepted in ((limit, True), (limit + 1, False)):
                if final <= prompt_len:      # (the prompt alone past the full-length bound)
                    continue
                params = BeamSearchParams(width, max_new_tokens=final - prompt_len,
                                          ignore_eos=True, stop_token_ids=stops)
                try:
                    engine.abort(engine.add_beam_request(prompt, params))
                    engine.run_until_done()
                    assert accepted, (prompt_len, width, runs, final)
                except RequestRejectedError:
                    assert not accepted, (prompt_len, width, runs, final)
        assert below_full > 0      # the full-length bound alone let these through
