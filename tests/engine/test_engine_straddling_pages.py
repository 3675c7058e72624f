"""Models whose bytes per token do not divide the page (issue 17 item 1) run on the host driver
forced to 4 KiB or 64 KiB pages, as they would on CUDA's 2 MiB pages, each page group backed
only by the pages its tokens' bytes need: greedy output through ``Engine`` (prefix sharing and
forks on) and through ``VMemCache`` equals transformers' own generate. (4 KiB keeps page groups small enough for a prompt to fill, so prefixes are hit.)"""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.hf import VMemCache  # noqa: E402
from vmemkv.scheduler.layout import PoolBacking  # noqa: E402

from .conftest import prompts, tokens  # noqa: E402

KiB = 2**10
SMALL_PAGE, PAGE = 4 * KiB, 64 * KiB
# name -> (LlamaConfig fields, layout, pages per page-group member); fp32 bytes per token per page
SHAPES = {
    "head_dim-80": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=80), "per-layer", 5),
    "head_dim-96": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=96), "per-layer", 3),
    "3-kv-heads": (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                        head_dim=16), "per-layer", 3),
    "interleaved-28-layers": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   num_hidden_layers=28), "interleaved", 7),
}


@functools.lru_cache(maxsize=None)
def _model(name: str):
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(SHAPES[name][0])
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()


def _reference(name: str, batch, new_tokens: int) -> list:
    """transformers' generate with its default cache, one prompt at a time, EOS ignored."""
    model, out = _model(name), []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt])      # every token attends, pad id or not
            ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_greedy_on_straddling_pages_equals_transformers_with_prefix_sharing(name):
    _, layout, pages_per_member = SHAPES[name]
    base = prompts(1, 70, 70, seed=4)[0]
    batch = [base, base + [7, 8, 9], base[:20] + [1, 2, 3], prompts(1, 5, 30, seed=5)[0]]
    expected = _reference(name, batch, 6)
    model = _model(name)
    # a 70-token step budget admits base alone first: the others hit what it computed
    with Engine(model, max_batch=4, max_context=128, layout=layout, page_bytes=SMALL_PAGE,
                max_tokens_per_step=70, prefix_sharing=True, check_integrity=True) as engine:
        assert engine.cache.geometry.pages_per_member == pages_per_member
        assert engine.cache.manager.backing is PoolBacking.BYTES       # groups backed by their bytes
        out = engine.generate(batch, SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert engine.scheduler.gauges()["prefix_cache_hits"] > 0
        forked = engine.generate([batch[1]], SamplingParams(max_new_tokens=6, n=2, ignore_eos=True))
    assert tokens(out) == expected
    assert [o.token_ids for o in forked[0].outputs] == [expected[1]] * 2


@pytest.mark.parametrize("name", ["head_dim-80", "interleaved-28-layers"])
def test_vmem_cache_greedy_on_straddling_pages_equals_default_cache(name):
    _, layout, pages_per_member = SHAPES[name]
    model = _model(name)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0                       # left padding
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                              do_sample=False, pad_token_id=0)
        with VMemCache.from_model_config(model.config, max_batch=3, max_context=64, layout=layout,
                                         page_bytes=PAGE) as cache:
            assert cache.kv.geometry.pages_per_member == pages_per_member
            assert cache.manager.backing is PoolBacking.BYTES
            got = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False, pad_token_id=0, cache=cache)
            cache.manager.check_integrity()
    assert torch.equal(got, want)


def test_vmem_cache_on_straddling_pages_holds_its_rows_by_bytes():
    """head_dim 80 on 64 KiB pages: 512-token groups of 4 members x 5 pages; a budget of one
    group (5 slices of 4 pages) holds two rows of 200 tokens (2 slices each), which whole
    groups could not, and refuses growing them to 300 (3 slices each) with nothing changed."""
    from vmemkv.runtime.hf.cache import CacheCapacityError
    config = _model("head_dim-80").config
    with VMemCache.from_model_config(config, max_batch=2, max_context=512, page_bytes=PAGE,
                                     cache_bytes=20 * PAGE) as cache:
        kv = torch.zeros(2, 2, 200, 80)
        for layer in range(2):
            cache.update(kv, kv, layer)
        assert cache.kv.manager.bound_pages == 2 * 2 * 4
        with pytest.raises(CacheCapacityError, match="needs 2 page slices of 4 pages; .* has 1"):
            cache.update(torch.zeros(2, 2, 100, 80), torch.zeros(2, 2, 100, 80), 0)
        assert cache.get_seq_length() == 200 and cache.kv.manager.bound_pages == 16


def test_a_persistent_fault_growing_a_groups_pages_fails_that_request_only():
    """3 KV heads on 4 KiB pages: a member's first page holds 21 tokens, so an 8-12 token prompt
    growing by 14 needs a MapExtent growing its group (first_page > 0); a fault on every map of the victim's slot
    is blamed on the sequence mapping that group, which fails; the others finish exactly."""
    from vmemkv import vmem
    from .test_engine_faults import SlotFaultDriver, slot_spans
    batch = prompts(3, 8, 12, seed=12)
    want = _reference("3-kv-heads", batch, 14)
    driver = SlotFaultDriver(vmem.open_driver("host"))
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    with Engine(_model("3-kv-heads"), driver=driver, max_batch=4, max_context=128,
                page_bytes=SMALL_PAGE, max_plan_retries=0, check_integrity=True) as engine:
        assert engine.cache.manager.backing is PoolBacking.BYTES
        ids = [engine.add_request(p, params) for p in batch]
        engine.step()                                    # prefill: one page a member each
        seq = next(s for s in engine.scheduler.running if s.request.request_id == ids[0])
        driver.spans = slot_spans(engine.cache, engine.cache.manager.slot_of(seq.seq_id))
        engine.run_until_done()                          # no error reaches the caller
        out = [engine.output(rid, pop=True) for rid in ids]
        engine.cache.check_integrity()
    assert out[0].status == "failed" and "injected persistent fault" in out[0].error.message
    assert [o.status for o in out[1:]] == ["finished"] * 2 and tokens(out)[1:] == want[1:]
