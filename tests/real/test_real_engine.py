"""SmolLM2-135M-Instruct through the engine: greedy chat answers equal transformers' on every
layout and through VMemCache, EOS stops where transformers stops, text round-trips CJK and emoji
(streamed and not), perplexity through prompt logprobs equals a plain forward within 1e-4 nats,
and stop strings end the text across token boundaries."""
from __future__ import annotations

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams

from .conftest import CONVERSATIONS, NEW_TOKENS, forward_logprobs

pytestmark = pytest.mark.real_model
NATS = 1e-4


def test_engine_chat_equals_transformers_and_stops_at_eos(engine_outputs, hf_greedy, real_model,
                                                          real_engine):
    _, tokenizer = real_model
    assert [o.outputs[0].token_ids for o in engine_outputs] == hf_greedy
    chatted = real_engine.chat(CONVERSATIONS[:1], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert chatted[0].outputs[0].token_ids == hf_greedy[0]   # Engine.chat renders the same ids
    reasons = [o.outputs[0].finish_reason for o in engine_outputs]
    assert reasons == ["stop", "length", "length"]      # EOS where transformers stopped
    assert [len(t) for t in hf_greedy] == [8, NEW_TOKENS, NEW_TOKENS]
    first = engine_outputs[0].outputs[0]
    assert first.token_ids[-1] == tokenizer.eos_token_id
    assert first.text == "The capital of France is Paris."


def test_the_paged_layout_gives_the_same_tokens(real_model, chat_ids, hf_greedy):
    model, tokenizer = real_model
    with Engine(model, tokenizer, cache="paged", block_size=16, max_batch=4, max_context=256) as engine:
        outs = engine.generate(chat_ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy


def test_vmem_cache_generate_equals_transformers(reference, chat_ids, hf_greedy):
    from vmemkv.runtime.hf import VMemCache
    for ids, want in list(zip(chat_ids, hf_greedy))[:1]:   # the answer that ends at EOS
        cache = VMemCache.from_model_config(reference.config, max_batch=1, max_context=128)
        try:
            with torch.inference_mode():
                out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                         do_sample=False, cache=cache)
        finally:
            cache.close()
        assert out[0, len(ids):].tolist() == want


def test_cjk_and_emoji_text_round_trips_streamed_and_not(engine_run, real_model):
    _, tokenizer = real_model
    outputs, events = engine_run
    texts = [o.outputs[0].text for o in outputs]
    for out in outputs:
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert texts[1].startswith("日本の首都") and "\U0001F31F" in texts[2]   # 🌟: 3 tokens
    for text, stream in zip(texts, events):
        assert "".join(e.text for e in stream) == text
        assert all("\ufffd" not in e.text for e in stream[:-1])   # no half character mid-stream
        assert any(e.text == "" for e in stream[1:]) or text.isascii()   # held back, then shown


def test_perplexity_through_prompt_logprobs_equals_a_plain_forward(engine_outputs, reference):
    for out in engine_outputs:
        ids, sample = out.prompt_token_ids, out.outputs[0]
        reference_lp = forward_logprobs(reference, tuple(ids) + tuple(sample.token_ids))
        entries = out.prompt_logprobs
        assert entries[0] is None and len(entries) == len(ids)
        nll = -sum(e.logprob for e in entries[1:])
        want = -sum(reference_lp[i - 1, ids[i]].item() for i in range(1, len(ids)))
        assert abs(nll - want) <= NATS, (nll, want)
        assert max(abs(e.logprob - reference_lp[i - 1, ids[i]].item())
                   for i, e in enumerate(entries) if i) <= NATS
        for step, entry in enumerate(sample.logprobs):   # the answers' logprobs too
            assert abs(entry.logprob - reference_lp[len(ids) - 1 + step, entry.token_id].item()) <= NATS


def test_a_stop_string_across_token_boundaries_ends_the_answer(real_engine, chat_ids, engine_outputs):
    text = engine_outputs[0].outputs[0].text          # "The capital of France is Paris."
    params = SamplingParams(max_new_tokens=NEW_TOKENS, stop=["ce is Par"])   # inside 3 tokens
    out = real_engine.generate(chat_ids[:1], params)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("The capital of Fran", "stop")
    assert out.token_ids == engine_outputs[0].outputs[0].token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < len(engine_outputs[0].outputs[0].token_ids)
    kept = real_engine.generate(chat_ids[:1], SamplingParams(
        max_new_tokens=NEW_TOKENS, stop=["ce is Par"], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[:text.index("ce is Par") + len("ce is Par")]


def test_chat_without_a_template_is_refused(real_model):
    from vmemkv.runtime.engine.chat import ChatTemplateError
    model, tokenizer = real_model
    # (self_check=False: the paged self-check of this model is the paged test's)
    with Engine(model, None, cache="paged", max_batch=2, max_context=64,
                self_check=False) as engine:
        with pytest.raises(ChatTemplateError, match="no tokenizer"):
            engine.chat(CONVERSATIONS[0])
        assert not engine.has_unfinished()


def test_calibrated_8_bit_scales_come_from_the_chat_template_and_not_from_the_batch(real_model,
                                                                                    chat_ids):
    from vmemkv.runtime.kv_calibration import calibration_ids
    model, tokenizer = real_model
    ids = calibration_ids(tokenizer, model.config.vocab_size, 10_000)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and "<|im_start|>assistant\nA hash table" in text
    assert 200 < len(ids) < 400
    # self_check=False here and below: the self-check runs in the model's own dtype
    # (kv_cache_dtype "auto"), so on this model and the default vmem cache it is the check the
    # module's real_engine already passed; these tests are about the scales
    # 4 tokens: scales taken from the batch (kv_scales=None, the first prefill's) change the
    # answer at its first token already
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    answers = []
    for batch in ([chat_ids[0]], [chat_ids[1], chat_ids[0]]):   # alone, then second
        with Engine(model, tokenizer, kv_cache_dtype="fp8_e4m3", kv_scales="calibrate",
                    max_batch=4, max_context=512, self_check=False) as engine:
            assert engine.kv_scales_source == "calibrated"
            answers.append(engine.generate(batch, params)[-1].outputs[0].token_ids)
    assert answers[0] == answers[1]


def test_a_chat_template_that_refuses_the_calibration_conversation_falls_back_to_its_text(
        real_model):
    import copy

    from vmemkv.runtime.kv_calibration import CALIBRATION_CONVERSATION, calibration_ids
    model, tokenizer = real_model
    strict = copy.deepcopy(tokenizer)    # a template that takes no assistant turn
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                            "{{ raise_exception('no assistant turns') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    text = "\n\n".join(turn["content"] for turn in CALIBRATION_CONVERSATION)
    assert calibration_ids(strict, model.config.vocab_size, 10_000) == tokenizer(text)["input_ids"]
    with Engine(model, strict, kv_cache_dtype="int8", kv_scales="calibrate", max_batch=2,
                max_context=128, self_check=False) as engine:   # calibrates on the first 128 tokens
        assert engine.kv_scales_source == "calibrated"
