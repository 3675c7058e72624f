"""Streamed ``text_offset`` while a stop string holds text back: every streamed logprobs entry
equals the non-streamed one, and no chunk's offset points past the text sent so far. The old
stream sent a token whose text was held with its uncut offset and cut only the last chunk's:
"The capital of France is" on SmolLM2 with stop "\\n\\nThe answer is:" gave
[0, 6, 7, 8, 9, 12, 19, 7] for the text " Paris." (non-streamed [0, 6, 7, 7, 7, 7, 7, 7])."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vmemkv.runtime.engine.detokenize import IncrementalText
from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.serve.completions import CompletionFormat, ServedModel
from vmemkv.runtime.serve.logprobs_format import TokenStrings
from vmemkv.runtime.serve.protocol import CompletionRequest
from vmemkv.runtime.serve.submission import Choice, Delta

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, serving, wait_until_idle
from .test_text_offset import streamed_choices

PROMPT = "ab"


def engine_deltas(tok, output: str, stop: list, include_stop: bool = False) -> list:
    """The Deltas the engine sends for ``output``'s tokens (one a byte) and ``stop``: each
    token's text from the engine's own IncrementalText, ending at a stop string or the last
    token ("length")."""
    ids = list(output.encode())
    text, deltas = IncrementalText(tok, stop, include_stop), []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        shown = text.add(token, last=last)
        reason = "stop" if text.stopped else "length" if last else None
        deltas.append(Delta(0, shown, [token], [TokenLogprobs(token, -1.0 - i, 1)], reason))
        if reason is not None:
            return deltas
    raise AssertionError("the output never ended")


def formats(tok, stop: list, include_stop: bool, echo: bool) -> tuple:
    req = CompletionRequest(prompt=PROMPT, max_tokens=64, logprobs=0, echo=echo, stop=stop,
                            include_stop_str_in_output=include_stop)
    served = ServedModel("tiny", tok, 256, 128, 8)
    submission = SimpleNamespace(prompt_logprobs=[None])
    prompt_ids = [list(PROMPT.encode())]
    return tuple(CompletionFormat(req, served, [PROMPT], prompt_ids, submission)
                 for _ in range(2))


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("output, stop, include_stop", [
    (" Paris.\n\nThe answer is: Paris", ["\n\nThe answer is:"], False),   # 16 tokens
    (" Paris.\n\nThe answer is: Paris", ["\n\nThe answer is:"], True),
    ("cdXYZw", ["XYZ"], False),
    ("日本XY語XYZ", ["XYZ", "本XY語X"], False),       # a multi-byte stop string, 3 bytes a char
    ("🎉 done 🎉🎉", ["🎉🎉"], False),                 # 8 tokens in the stop string
    ("cdXY", ["XYZ"], False),                          # ends "length" holding "XY"
], ids=["answer-is", "answer-is-kept", "xyz", "cjk", "emoji", "length-while-held"])
def test_streamed_offsets_equal_the_non_streamed_ones(output, stop, include_stop, echo):
    tok = byte_tokenizer()
    deltas = engine_deltas(tok, output, stop, include_stop)
    whole, stream = formats(tok, stop, include_stop, echo)
    ids = [t for d in deltas for t in d.token_ids]
    done = whole.choice(Choice(0, "".join(d.text for d in deltas), ids,
                               [e for d in deltas for e in d.logprobs], deltas[-1].finish_reason))
    text, streamed_ids = "", []
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, delta in enumerate(deltas):
        chunk = stream.chunk(delta)
        text += chunk["text"]
        lp = chunk["logprobs"]
        assert all(o <= len(text) for o in lp["text_offset"])   # never past what was sent
        echoed = len(PROMPT) if echo and i == 0 else 0          # the prompt's tokens first
        assert lp["tokens"][echoed:] == [TokenStrings(tok).key(t) for t in chunk["token_ids"]]
        streamed_ids += chunk["token_ids"]
        for key in streamed:
            streamed[key] += lp[key]
    assert text == done["text"] and streamed_ids == ids == done["token_ids"]
    assert streamed == done["logprobs"]
    offsets = done["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)


def test_the_answer_is_stop_holds_the_tokens_it_cuts():
    """The hunted case's shape, one token a byte: " Paris." then the 16-character stop."""
    tok = byte_tokenizer()
    output = " Paris.\n\nThe answer is:"
    deltas = engine_deltas(tok, output, ["\n\nThe answer is:"])
    _, stream = formats(tok, ["\n\nThe answer is:"], False, False)
    chunks = [stream.chunk(d) for d in deltas]
    assert "".join(c["text"] for c in chunks) == " Paris."
    offsets = [c["logprobs"]["text_offset"] for c in chunks]
    assert sum(offsets, []) == list(range(7)) + [7] * 16
    # the text is held until the stop string could no longer start in it: so are its tokens
    assert [len(o) for o in offsets] == [0] * 15 + [1] * 7 + [16]
    assert chunks[-1]["finish_reason"] == "stop" and len(chunks[-1]["token_ids"]) == 16


def streamed_offsets(url: str, request: dict) -> tuple:
    text, token_ids, offsets = "", [], []
    for c in streamed_choices(url, request):
        text += c["text"]
        assert all(o <= len(text) for o in c["logprobs"]["text_offset"])
        token_ids += c["token_ids"]
        offsets += c["logprobs"]["text_offset"]
    return text, token_ids, offsets


def test_served_stream_offsets_equal_the_response_with_a_three_token_stop():
    """Random weights made to say "X" (logit_bias) until the stop string "XXX" cuts it all."""
    tok = byte_tokenizer()
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "echo": True,
            "stop": "XXX", "logit_bias": {str(ord("X")): 100}, "ignore_eos": True}
    with serving(VMEM, tokenizer=tok) as (server, engine):
        done = local_http.post(server.url + "/v1/completions", json=body).json()["choices"][0]
        assert (done["text"], done["finish_reason"]) == (PROMPT, "stop")
        assert done["token_ids"] == [ord("X")] * 3
        assert done["logprobs"]["text_offset"] == [0, 1, 2, 2, 2]
        assert streamed_offsets(server.url, body) == (PROMPT, done["token_ids"],
                                                      [0, 1, 2, 2, 2])
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
