"""Memory behind the window, given back for real: a model whose every layer is windowed (Mistral,
window 8) runs on the vmem cache (both layouts) with the page groups wholly behind every
sequence's window unmapped from the real VirtualRange, greedy-exact against transformers; the
cache refuses any read or step that would touch memory a plan gave back."""
from __future__ import annotations

import pytest

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.kv import make_kv

from ..hf.window_families import WINDOW, build, hf_greedy
from ..hf.test_window_models import prompts

KiB = 1024
LAYOUT_TPP = {"per-layer": 32, "interleaved": 16}   # tokens per 4 KiB page of the tiny models


@pytest.mark.parametrize("layout", list(LAYOUT_TPP))
def test_groups_behind_the_window_are_unmapped_while_tokens_stay_exact(layout):
    batch, new = prompts(3, 20, 20, seed=4), 90            # contexts reach 110: 13 windows
    tpp = LAYOUT_TPP[layout]
    held_max = -(-WINDOW // tpp) + 2                       # window, the page being written, one
    with Engine(build("mistral"), max_batch=4, max_context=128, cache="vmem", layout=layout,
                page_bytes=4 * KiB, check_integrity=True) as engine:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True))
               for p in batch]
        kv, peak_tokens = engine.cache, 0
        while engine.has_unfinished():
            engine.step()
            if kv.manager.stats().live_tokens:
                peak_tokens = max(peak_tokens, kv.manager.stats().allocated_tokens)
                assert len(kv.range.mapped_pages()) <= 3 * held_max * kv.manager.pages_per_group
        got = [engine.output(i).outputs[0].token_ids for i in ids]
    assert kv.manager.window_tokens == WINDOW
    assert peak_tokens <= 3 * held_max * tpp < 3 * (20 + new)   # full allocation would hold it all
    assert got == hf_greedy("mistral", batch, new)


def _kv(layout="per-layer"):
    config = CacheConfig(2, 2, 16, max_batch=2, max_context=128, layer_windows=(8, 8))
    return make_kv(config, "vmem", layout=layout, page_bytes=4 * KiB)


def test_a_step_that_would_read_behind_the_given_back_memory_is_refused():
    with _kv() as kv:
        kv.manager.allocate(0, 100)
        kv.manager.release_behind_window(0, 100)          # keys from 93 on: pages 0, 1 go
        kv.execute(kv.manager.take_ops())
        assert sorted(kv.cache.mapped_pages(kv.manager.slot_of(0))) == [2, 3]
        kv.begin_step([(0, 99, 1)])                        # reads keys 92.. (page 2): fine
        with pytest.raises(CacheStateError, match="reads keys from token 53 .* before token 64"):
            kv.begin_step([(0, 60, 40)])
        with pytest.raises(CacheStateError, match="given back behind a sliding window"):
            kv.read(0, 0, 100)
        kv.check_integrity()


def test_a_sequence_that_gave_memory_back_is_recomputed_not_swapped():
    from vmemkv.scheduler.managers.window import WindowSwapError
    with _kv() as kv:
        kv.manager.allocate(0, 100)
        kv.manager.release_behind_window(0, 100)
        assert not kv.manager.can_swap_out(0)
        with pytest.raises(WindowSwapError, match="gave back 2 page groups behind its 8-token window"):
            kv.manager.swap_out(0)
        kv.manager.free(0)
        kv.execute(kv.manager.take_ops())
        kv.check_integrity()
