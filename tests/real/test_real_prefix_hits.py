"""Block-granular prefix hits with the real model (issue 28): SmolLM2-135M-Instruct, a shared
system prompt and the same 4 chat prompts sent twice, two at a time, as a new user would try it
(the second pair hits the first's system prompt, the repeats their whole prompts).

On the host's default pages a vmem page group of this model holds 256 tokens (30 layers, 3 KV
heads x 64, fp32), more than any of these prompts: with whole-page hits only, vmem served none of
the repeats (0/513 hit tokens of 8 such prompts when the issue was filed). With block-granular
hits it serves within 5% of paged-16's, and the answers are transformers' own greedy tokens,
hits and all. Both runs are given room for 16 page groups (11.25 MiB each): at the default memory
of 4 x 512 tokens vmem keeps fewer turns cached than paged (a 54-token turn holds a 256-token
page): with 8 prompts it served 400 of paged's 512 hit tokens, the page size's memory cost, not
the hits'."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams

pytestmark = pytest.mark.real_model
NEW_TOKENS = 4
GROUP_BYTES = 30 * 2 * 256 * 3 * 64 * 4     # a page group: 30 layers x K/V x 256 tokens, fp32
SYSTEM = ("You are the help desk of a small public library. Answer in one short, friendly "
          "sentence, and never invent opening hours or fees you were not told about.")
QUESTIONS = ["Can I renew a book online?", "Do you lend e-readers?",
             "Where can I print a document?", "Is there a quiet room for studying?"]
AT_A_TIME = 2


@pytest.fixture(scope="module")
def prompts(real_model):
    _, tokenizer = real_model
    ids = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": q}],
                                         tokenize=True, return_dict=False, add_generation_prompt=True)
           for q in QUESTIONS]
    return ids + ids                        # the same 4 prompts, sent again


def _run(real_model, prompts, **options):
    """The prompts two at a time, each pair after the last has finished: (token ids per prompt,
    prompt tokens served from the prefix cache, the run's page size in tokens)."""
    model, tokenizer = real_model
    # self_check=False: this model's self-check on vmem and on paged-16 runs in test_real_engine
    # (its real_engine and its paged test); this test is about the hits
    with Engine(model, tokenizer, max_batch=4, max_context=512, cache_bytes=16 * GROUP_BYTES,
                prefix_sharing=True, check_integrity=True, self_check=False, **options) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        outs = []
        for i in range(0, len(prompts), AT_A_TIME):
            outs += engine.generate(prompts[i:i + AT_A_TIME], params)
        geometry = engine.cache.manager.layout().geometry
        return ([o.outputs[0].token_ids for o in outs], engine.cache.manager.prefix_hits,
                None if geometry is None else geometry.tokens_per_page)


def test_vmem_serves_the_repeats_from_the_cache_within_five_percent_of_paged(real_model, reference,
                                                                             prompts):
    paged_tokens, paged_hits, _ = _run(real_model, prompts, cache="paged", block_size=16)
    vmem_tokens, vmem_hits, tokens_per_page = _run(real_model, prompts, cache="vmem")
    first = prompts[:len(QUESTIONS)]
    repeated = sum(len(p) for p in prompts[len(QUESTIONS):])
    assert tokens_per_page > max(len(p) for p in prompts), \
        "meant to run on pages larger than any prompt (the issue's case)"
    assert paged_hits > 0.7 * repeated, (paged_hits, repeated)
    assert abs(vmem_hits - paged_hits) <= 0.05 * paged_hits, (vmem_hits, paged_hits, repeated)
    expected = []
    for ids in first:
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    assert vmem_tokens == paged_tokens == expected * 2
