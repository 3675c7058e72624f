"""A beam search that finishes alone finishes in a batch under swap preemption: a group swapped
back in (each beam its own copy of the history they share) that cannot grow with the cache to
itself is recomputed, sharing that history again (tests/scheduler/test_beam_swap_regrow.py),
where it had failed."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams

from .conftest import model, prompts

PARAMS = BeamSearchParams(4, max_new_tokens=8, ignore_eos=True)
# 12 blocks of 4 tokens: the third prompt's 4 beams swapped back in at 12 tokens hold 3 blocks
# each (all 12); recomputed they share the prompt's 3 and need 4 more to reach 13 tokens
OPTIONS = dict(cache="paged", block_size=4, cache_bytes=24 * 1024, max_batch=16,
               max_context=128, check_integrity=True, preemption="swap")


def run(batch):
    with Engine(model("tiny-llama"), swap_bytes=512 * 1024, **OPTIONS) as engine:
        out = engine.beam_search(batch, PARAMS)
        assert engine.kv.manager.stats().live_tokens == 0
        return out, engine.last_stats


def beams(output):
    return [(c.token_ids, round(c.beam_score, 4)) for c in output.outputs]


def test_a_group_swapped_in_that_cannot_grow_alone_is_recomputed_and_finishes():
    batch = prompts(3, 5, 20, seed=1)
    assert [len(p) for p in batch] == [9, 20, 12]
    out, stats = run(batch)
    # both later groups swapped out whole; the third came back privately and was recomputed
    assert stats.num_swap_preemptions == 8 and stats.num_preemptions == 12
    assert [o.status for o in out] == ["finished"] * 3          # the third had failed
    alone, _ = run(batch[2:])
    assert beams(out[2]) == beams(alone[0]) and len(out[2].outputs) == 4
