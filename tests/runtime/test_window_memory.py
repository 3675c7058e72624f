"""Memory behind the window, given back for real: a model whose every layer is windowed (Mistral,
window 8) runs on the vmem cache (both layouts: the page groups wholly behind every sequence's
window unmapped from the real VirtualRange) and on paged (those blocks freed), greedy-exact
against transformers; the caches refuse any read or step that would touch memory a plan gave
back."""
from __future__ import annotations

import pytest

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.kv import make_kv

from ..hf.window_families import WINDOW, build, hf_greedy
from ..hf.test_window_models import prompts
from ..vmem_only_options import options_for

KiB = 1024
LAYOUT_TPP = {"per-layer": 32, "interleaved": 16, "paged": 4}   # tokens per page / block
CACHE = {"per-layer": dict(cache="vmem", layout="per-layer", page_bytes=4 * KiB),
         "interleaved": dict(cache="vmem", layout="interleaved", page_bytes=4 * KiB),
         "paged": dict(cache="paged", block_size=4)}


@pytest.mark.parametrize("layout", list(LAYOUT_TPP))
def test_memory_behind_the_window_is_given_back_while_tokens_stay_exact(layout):
    batch, new = prompts(3, 20, 20, seed=4), 90            # contexts reach 110: 13 windows
    tpp = LAYOUT_TPP[layout]
    held_max = -(-WINDOW // tpp) + 2                       # window, the page being written, one
    with Engine(build("mistral"), max_batch=4, max_context=128, check_integrity=True,
                **CACHE[layout]) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
               for p in batch]
        kv, peak_tokens, steps = engine.cache, 0, 0
        while engine.has_unfinished():
            engine.step()
            steps += 1                 # past the prompts' allocation (20 tokens each)
            if steps > 20 and kv.manager.stats().live_tokens:
                peak_tokens = max(peak_tokens, kv.manager.stats().allocated_tokens)
                if layout != "paged":    # the real range: mapped pages follow the window
                    assert len(kv.range.mapped_pages()) <= 3 * held_max * kv.manager.pages_per_group
        got = [engine.output(i).outputs[0].token_ids for i in ids]
    assert kv.manager.window_tokens == WINDOW
    assert peak_tokens <= 3 * held_max * tpp < 3 * (20 + new)   # full allocation would hold it all
    assert got == hf_greedy("mistral", batch, new)


def _kv(kind="vmem"):
    config = CacheConfig(2, 2, 16, max_batch=2, max_context=128, layer_windows=(8, 8))
    return make_kv(config, kind, block_size=32, **options_for(kind, page_bytes=4 * KiB))


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_a_step_that_would_read_behind_the_given_back_memory_is_refused(kind):
    with _kv(kind) as kv:
        kv.manager.allocate(0, 100)
        kv.manager.release_behind_window(0, 100)          # keys from 93 on: units 0, 1 go
        kv.execute(kv.manager.take_ops())
        if kind == "vmem":
            assert sorted(kv.cache.mapped_extents(kv.manager.slot_of(0))) == [2, 3]
        else:
            assert kv.manager.block_table(0)[:2] == [None, None]
        kv.begin_step([(0, 99, 1)])                        # reads keys 92.. (unit 2): fine
        # tokens 60.. are written where memory was given back (vmem names the write; paged
        # the read from 53)
        refusal = ("writing tokens up to 100 but the plans mapped no memory of its 'window-8' "
                   "layers for token 60" if kind == "vmem" else
                   "reads keys from token 53 but the plans gave back its blocks before token 64")
        with pytest.raises(CacheStateError, match=refusal):
            kv.begin_step([(0, 60, 40)])
        with pytest.raises(CacheStateError, match="given back behind a sliding window"):
            kv.read(0, 0, 100)
        kv.check_integrity()


def test_a_paged_read_of_one_key_in_a_given_back_block_is_refused():
    with _kv("paged") as kv:
        kv.manager.allocate(0, 100)
        kv.manager.release_behind_window(0, 100)          # blocks 0, 1 (tokens 0..63) go
        kv.execute(kv.manager.take_ops())
        kv.begin_step([(0, 71, 1)])                        # keys 64..71: the first block held
        with pytest.raises(CacheStateError, match="reads keys from token 63 but the plans gave "
                                                  "back its blocks before token 64"):
            kv.begin_step([(0, 70, 1)])
        kv.check_integrity()

@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_a_sequence_that_gave_memory_back_is_recomputed_not_swapped(kind):
    from vmemkv.scheduler.managers.window import WindowSwapError
    with _kv(kind) as kv:
        kv.manager.allocate(0, 100)
        kv.manager.release_behind_window(0, 100)
        assert not kv.manager.can_swap_out(0)
        with pytest.raises(WindowSwapError, match="gave back 2 page groups behind its 8-token window"):
            kv.manager.swap_out(0)
        kv.manager.free(0)
        kv.execute(kv.manager.take_ops())
        kv.check_integrity()
