"""Text through the server: text prompts with a tokenizer give Engine.generate's text; a stop
string ends a choice with finish_reason "stop", is not in the text, and the request's memory
comes back. ChoiceText (incremental text, stop strings) against a shadow model."""
from __future__ import annotations

import json

import httpx
from hypothesis import given, strategies as st

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.serve.text import ChoiceText

from ..engine.test_text_prompts import TEXTS, make_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, model, serving, wait_until_idle

BODY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def reference_texts(tokenizer) -> list[str]:
    with Engine(model(), tokenizer, **VMEM) as engine:
        outs = engine.generate(TEXTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def streamed_text(url: str, body: dict) -> tuple[str, str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_text_prompts_give_the_engines_text_and_stop_strings_cut_it():
    tokenizer = make_tokenizer()
    want = reference_texts(tokenizer)
    with serving(VMEM, tokenizer=tokenizer) as (server, engine):
        for prompt, text in zip(TEXTS, want):
            got = httpx.post(server.url + "/v1/completions", json={**BODY, "prompt": prompt}).json()
            assert got["choices"][0]["text"] == text
            assert streamed_text(server.url, {**BODY, "prompt": prompt}) == (text, "length")
            stop = text.split()[2]            # a word the greedy output reaches
            cut = text[:text.index(stop)]
            body = {**BODY, "prompt": prompt, "stop": [stop]}
            got = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
            assert (got["text"], got["finish_reason"]) == (cut, "stop")
            assert streamed_text(server.url, body) == (cut, "stop")
        wait_until_idle(server)
        assert_memory_at_baseline(engine)


class WordTokenizer:
    """decode(ids) = the words of ids joined by spaces (like the WordLevel tokenizer above)."""
    WORDS = ["a", "b", "ab", "ba", "c", "abc"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS[i] for i in ids)


@given(ids=st.lists(st.integers(0, 5), min_size=1, max_size=12),
       stops=st.lists(st.sampled_from(["a", "b c", "ba", "c a", "zz"]), max_size=3))
def test_choice_text_deltas_add_up_to_the_text_before_the_first_stop(ids, stops):
    tok = WordTokenizer()
    choice, sent = ChoiceText(tok, stops), ""
    for i, token in enumerate(ids):
        delta, _ = choice.add(token, "length" if i == len(ids) - 1 else None)
        sent += delta
        assert all(s not in sent for s in stops)   # never shows a stop string
        if choice.finished:
            break
    full = tok.decode(ids[:len(choice.token_ids)])
    hits = [full.find(s) for s in stops if s in full]
    shadow = full[:min(hits)] if hits else full
    assert sent == choice.text == shadow
    assert choice.finish_reason == ("stop" if hits else "length")
