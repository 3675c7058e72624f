"""Multi-LoRA on the real model (issue 31): SmolLM2-135M-Instruct with a small rank-8 adapter on
q_proj and v_proj (made here with peft, ``init_lora_weights=False``, lora_B scaled down so the
answers stay sentences but change). One batch runs every chat prompt twice, once on the base
model and once on the adapter; on vmem and on paged, the engine's greedy tokens equal PEFT's
merged model's (``merge_and_unload``) for the adapter rows and transformers' for the base rows.

The engine runs the session's ``real_model`` copy: ``add_lora`` hooks its projections for good,
and with no LoRA batch set a hook changes nothing (runtime/lora/layers.py), so the other real
tests see the same model. The references run on copies of the ``reference`` model, which keeps
transformers' own attention.
"""
from __future__ import annotations

import copy

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams

pytestmark = pytest.mark.real_model
peft = pytest.importorskip("peft")

QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Why is the sky blue?",
             "Write a haiku about autumn."]
NEW_TOKENS = 8      # the adapter changes 3 of the 4 answers in 8 tokens (the haiku at its 9th)
B_FACTOR = 0.3      # lora_B scaled: answers change, and stay sentences
NAME = "qv8"
CACHES = {"vmem": dict(cache="vmem"), "paged": dict(cache="paged", block_size=16)}


@pytest.fixture(scope="module")
def prompts(real_model):
    _, tokenizer = real_model
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          return_dict=False, add_generation_prompt=True)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def adapter_dir(reference, tmp_path_factory):
    """A rank-8 q_proj + v_proj adapter in PEFT's files, lora_B scaled by ``B_FACTOR``."""
    path = tmp_path_factory.mktemp("real-lora") / NAME
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                 init_lora_weights=False)
        model = peft.get_peft_model(copy.deepcopy(reference), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(B_FACTOR)
    model.save_pretrained(str(path))
    return str(path)


def greedy(model, prompt) -> list:
    """transformers' greedy answer (EOS as the model says); an explicit all-ones mask."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(reference, adapter_dir, prompts):
    """{None: the base model's answers, NAME: PEFT's merged model's}, one per prompt."""
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(reference), adapter_dir)
    merged = merged.merge_and_unload()
    answers = {None: [greedy(reference, p) for p in prompts],
               NAME: [greedy(merged, p) for p in prompts]}
    del merged
    return answers


def test_the_adapter_changes_the_answers_and_keeps_them_sentences(references, real_model):
    _, tokenizer = real_model
    changed = [a != b for a, b in zip(references[None], references[NAME])]
    assert sum(changed) >= 1, "the adapter changed no answer: scale lora_B up"
    for answer in references[NAME]:
        text = tokenizer.decode(answer, skip_special_tokens=True)
        assert len(text.split()) >= 3 and "\ufffd" not in text, text


@pytest.mark.parametrize("cache", list(CACHES))
def test_mixed_batch_matches_peft_merged_and_base(cache, real_model, prompts, adapter_dir,
                                                   references):
    model, tokenizer = real_model
    names = [None, NAME] * len(prompts)            # every prompt on both arms, one batch
    batch = [p for p in prompts for _ in (0, 1)]
    # self_check=False: it runs before add_lora, on the base model: test_real_engine's check
    # of this model on vmem and on paged-16; this test is about the adapter
    with Engine(model, tokenizer, max_batch=len(batch), max_context=256, self_check=False,
                **CACHES[cache]) as engine:
        engine.add_lora(NAME, adapter_dir)
        outs = engine.generate(batch, [SamplingParams(max_new_tokens=NEW_TOKENS, lora=n)
                                       for n in names])
        stats = engine.kv.manager.adapter_stats()
    got = [o.outputs[0].token_ids for o in outs]
    want = [references[n][i // 2] for i, n in enumerate(names)]
    for i, (ours, theirs) in enumerate(zip(got, want)):
        arm = names[i] or "base"
        assert ours == theirs, (f"{cache} prompt {i // 2} on {arm}: "
                                f"{tokenizer.decode(ours)!r} != {tokenizer.decode(theirs)!r}")
    assert (stats.loads, stats.evictions, stats.resident, stats.pinned) == (1, 0, 1, 0)
