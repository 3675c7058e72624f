"""Text out of the engine: incremental detokenization never shows a partial character, the
streamed deltas add up to ``decode(token_ids)``, and stop strings end a sample where they appear
on the text, also across token boundaries (IncrementalText against a shadow, and end to end on
a byte-level tokenizer where every CJK character or emoji spans several tokens)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from vmemkv.runtime.engine import Engine, RequestRejectedError, SamplingParams
from vmemkv.runtime.engine.detokenize import IncrementalText

from .byte_tokenizer import byte_tokenizer
from .conftest import model, prompts

MULTIBYTE = "日本の首都は東京です 🙂 naïve café ✓"


def test_multibyte_text_fed_token_by_token_round_trips():
    """The repro of issue 26: main's ChoiceText gave '�本の������す 🙂' for this text."""
    tok = byte_tokenizer()
    ids = tok(MULTIBYTE)["input_ids"]
    assert len(ids) > len(MULTIBYTE)          # several tokens per character
    text, deltas = IncrementalText(tok), []
    for i, token in enumerate(ids):
        deltas.append(text.add(token, last=i == len(ids) - 1))
    assert "".join(deltas) == text.text == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)


class WordTokenizer:
    """decode(ids) = the words of ids joined by spaces (a tokenizer whose windows decode alike)."""
    WORDS = ["a", "b", "ab", "ba", "c", "abc", "日", "🙂"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS[i] for i in ids)


@settings(max_examples=80)
@given(ids=st.lists(st.integers(0, 7), min_size=1, max_size=12),
       stops=st.lists(st.sampled_from(["a", "b c", "ba", "c a", "zz", "日 🙂"]), max_size=3),
       include=st.booleans())
def test_deltas_add_up_to_the_text_before_the_first_stop(ids, stops, include):
    tok = WordTokenizer()
    text, sent = IncrementalText(tok, stops, include_stop=include), ""
    for i, token in enumerate(ids):
        sent += text.add(token, last=i == len(ids) - 1)
        if not include:
            assert all(s not in sent for s in stops)   # never shows a stop string
        if text.stopped:
            break
    full = tok.decode(ids[:len(text.token_ids)])
    hits = [(full.find(s), s) for s in stops if s in full]
    at, stop = min(hits) if hits else (len(full), "")
    assert sent == text.text == full[:at + (len(stop) if include else 0)]
    assert text.stopped == bool(hits)


def _events_by_sample(events) -> dict:
    texts: dict = {}
    for e in events:
        texts.setdefault((e.request_id, e.index), []).append(e.text)
    return texts


def test_streamed_text_is_always_a_prefix_of_the_decoded_tokens():
    """Random weights over a byte vocabulary emit broken and multi-byte UTF-8 alike: at every
    event the text so far is a prefix of decode(tokens so far) minus what may still change, and
    the finished text is decode(token_ids)."""
    tok = byte_tokenizer()
    batch = prompts(6, 3, 12, seed=71)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, n=2, ignore_eos=True)
    with Engine(model(), tok, max_batch=8, max_context=64) as engine:
        shown: dict = {}
        for event in engine.stream(batch, params):
            key = (event.request_id, event.index)
            shown[key] = shown.get(key, "") + event.text
        outs = engine.last_outputs
    for out in outs:
        for sample in out.outputs:
            final = tok.decode(sample.token_ids)
            assert shown[(out.request_id, sample.index)] == sample.text == final


def test_stop_strings_across_token_boundaries_end_the_sample():
    tok = byte_tokenizer()
    prompt = [ord(c) for c in "abc"]
    letters = {t: 8.0 for t in range(ord("a"), ord("z") + 1)}   # mostly readable text
    free = SamplingParams(max_new_tokens=20, temperature=1.0, seed=9, ignore_eos=True,
                          logit_bias=letters)
    with Engine(model(), tok, max_batch=4, max_context=64) as engine:
        full = engine.generate([prompt], free)[0].outputs[0]
        text = full.text
        at = next(i for i in range(3, len(text) - 3) if "\ufffd" not in text[i:i + 3])
        stop = text[at:at + 3]                # three whole characters: at least three tokens
        first = text.find(stop)
        for include in (False, True):
            params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=9, ignore_eos=True,
                                    logit_bias=letters, stop=[stop, "never-there"],
                                    include_stop_str_in_output=include)
            events = list(engine.stream([prompt], params))
            got = engine.last_outputs[0].outputs[0]
            assert got.finish_reason == "stop" and events[-1].finish_reason == "stop"
            assert got.text == text[:first + (len(stop) if include else 0)]
            assert "".join(e.text for e in events) == got.text
            # the token that completed the stop string is the last one generated
            assert tok.decode(got.token_ids).startswith(text[:first] + stop)
            assert not tok.decode(got.token_ids[:-1]).startswith(text[:first] + stop)
            assert got.token_ids == full.token_ids[:len(got.token_ids)]
        assert engine.cache.manager.stats().live_tokens == 0


def test_one_sample_stopping_on_text_leaves_its_siblings_running():
    tok = byte_tokenizer()
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1, n=3, ignore_eos=True)
    with Engine(model(), tok, max_batch=4, max_context=64) as engine:
        free = engine.generate([[97, 98]], params)[0].outputs
        stop = free[0].text[2:4]
        assert "\ufffd" not in stop
        stopped = engine.generate([[97, 98]], SamplingParams(
            max_new_tokens=16, temperature=1.0, seed=1, n=3, ignore_eos=True, stop=[stop]))[0]
    for plain, got in zip(free, stopped.outputs):
        if stop in plain.text:
            assert got.finish_reason == "stop" and got.text == plain.text[:plain.text.find(stop)]
        else:
            assert (got.finish_reason, got.token_ids) == ("length", plain.token_ids)
    assert stopped.status == "finished"


def test_stop_strings_without_a_tokenizer_are_refused():
    with Engine(model(), max_batch=2, max_context=32) as engine:
        with pytest.raises(RequestRejectedError, match="stop strings need a tokenizer"):
            engine.add_request([1, 2], SamplingParams(stop=["x"]))


def test_special_tokens_are_kept_in_the_text_when_asked():
    tok = byte_tokenizer()
    tok_ids = tok("ok")["input_ids"]
    for skip in (True, False):
        text = IncrementalText(tok, skip_special_tokens=skip)
        assert "".join(text.add(t, last=i == 1) for i, t in enumerate(tok_ids)) == "ok"
