"""A hybrid model on pages that hold no whole token (hybrid x byte-mapped): Gemma 2's pattern
(one windowed layer, one full) with 3 KV heads x 16 x fp32 = 192 B a layer-token on 4 KiB
pages, so a member spans 3 pages and a page group holds 64 tokens. Each layer kind's extent is
backed by the pages its tokens' bytes need, and the window kind's extents behind the window go
back to the ledger: greedy tokens equal transformers', and the pool holds fewer pages than the
same sequence with every page kept.

    n tokens held:  full kind   2 members x slot_member_pages(n)
                    window kind 2 members x the pages of the groups the window still reads
"""
from __future__ import annotations

import functools

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.scheduler.managers import make_manager

from .test_window_models import prompts
from .window_families import G, WINDOW

transformers = pytest.importorskip("transformers")

KiB = 1024


@functools.lru_cache(maxsize=None)
def _model():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    fields = dict(G, hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                  sliding_window=WINDOW, attn_logit_softcapping=2.0, query_pre_attn_scalar=24)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(
            CONFIG_MAPPING["gemma2"](**fields), dtype=torch.float32).eval()


def _reference(prompt, new_tokens: int) -> list:
    model = _model()
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt])      # every token attends, pad id or not
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new_tokens, do_sample=False)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def test_hybrid_on_straddling_pages_decodes_exactly_and_gives_back_its_window_by_bytes():
    prompt, new = prompts(1, 20, 20, seed=5)[0], 60            # 80 tokens: past group 0 + W
    with Engine(_model(), max_batch=2, max_context=128, cache="vmem", layout="per-layer",
                page_bytes=4 * KiB, cache_bytes=64 * 4 * KiB, check_integrity=True) as engine:
        kv, execute, seen = engine.kv, engine.runner.execute, []
        geo, manager = kv.manager.geometry, kv.manager
        assert not geo.exact and geo.pages_per_member == 3 and geo.tokens_per_page == 64

        def checked(plan):
            out = execute(plan)
            kv.check_integrity()
            seen.append((kv.cache.mapped_pool_pages, plan.num_context_tokens,
                         manager.ledger.tenants()))
            return out
        engine.runner.execute = checked
        out = engine.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))
    assert out[0].outputs[0].token_ids == _reference(prompt, new)
    mapped, n, held = seen[-1]
    assert n == 79                                  # the last step's context: cached + new
    full = 2 * geo.slot_member_pages(n)             # 2 * (3 + 1) = 8: bytes, every group
    window = 2 * geo.member_pages_for(n - 64)       # group 0 behind the window: given back
    kept = 2 * full                                 # both kinds, every page kept
    assert (full, window) == (8, 2)
    assert mapped == full + window == 10 < kept == 16
    assert held == {"full": full, f"window-{WINDOW}": window}   # the rest is in the ledger
    # the same sequence on the same pool with every page kept (one kind of every layer)
    keep = make_manager("vmem", manager.model, manager.pool_pages * geo.page_bytes, 128,
                        page_bytes=geo.page_bytes, max_slots=2, hybrid_parts=False)
    keep.allocate(0, n)
    keep.release_behind_window(0, n)
    assert keep.bound_pages == kept and keep.ledger.tenants() == {"full": kept}
    # every step: at most every page kept for its context (equal until a group is behind)
    assert all(m <= 4 * geo.slot_member_pages(c) for m, c, _ in seen)
