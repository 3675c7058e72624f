"""Completions' ``top_logprobs`` name k distinct tokens by k distinct keys, each holding its own
token's logprob, and ``tokens[i]`` is the chosen token's key in ``top_logprobs[i]``. Keyed by
decoded string, the byte pieces of an emoji (each U+FFFD alone) had collapsed into one key
holding the likeliest's value: SmolLM2 gave fewer than k entries and, for the chosen token,
another token's logprob (hunt_realchat, 2026-12-07). Chat's logprobs are lists with each
token's own ``bytes``, exact already: pinned here too."""
from __future__ import annotations

import json

from vmemkv.runtime.engine.logprobs import TokenLogprobs
from vmemkv.runtime.serve.logprobs_format import TokenStrings, completion_logprobs

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import VMEM, serving

EMOJI = "Emoji party: 🎉🎉"


def byte_key(token_id: int) -> str:
    """The byte tokenizer's token (id == its byte) as completions name it."""
    return chr(token_id) if token_id < 0x80 else f"bytes:\\x{token_id:02x}"


def test_byte_pieces_of_one_character_get_distinct_keys_each_with_its_own_logprob():
    """0xF0 0x9F 0x8E 0x89 (🎉) each decode alone to U+FFFD; the chosen 0x89, unlikelier than
    all four of the top, was named U+FFFD holding 0xF0's -0.1."""
    strings = TokenStrings(byte_tokenizer())
    top = ((0xF0, -0.1), (0x9F, -0.2), (0x8E, -0.3), (ord("a"), -0.4))
    entry = TokenLogprobs(0x89, -5.0, 9, top)
    out = completion_logprobs(strings, [0x89], [entry], [0])
    assert out["tokens"] == ["bytes:\\x89"]
    assert out["top_logprobs"] == [{"bytes:\\xf0": -0.1, "bytes:\\x9f": -0.2, "bytes:\\x8e": -0.3,
                                    "a": -0.4, "bytes:\\x89": -5.0}]
    assert out["top_logprobs"][0][out["tokens"][0]] == out["token_logprobs"][0] == -5.0
    assert bytes.fromhex(out["tokens"][0][len("bytes:"):].replace("\\x", "")) == b"\x89"
    # the chosen among the top: k keys, its own value once; a whole character keeps its text
    chosen = TokenLogprobs(0x9F, -0.2, 2, top)
    assert completion_logprobs(strings, [0x9F], [chosen], [0])["top_logprobs"][0] \
        == {"bytes:\\xf0": -0.1, "bytes:\\x9f": -0.2, "bytes:\\x8e": -0.3, "a": -0.4}


class AliasTokenizer:
    """No byte pieces to tell them apart ("text" decoding): ids 1 and 2 both decode to U+FFFD,
    id 3 to the text "token_id:1"."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join({1: "\ufffd", 2: "\ufffd", 3: "token_id:1"}.get(i, f"<{i}>") for i in ids)


def test_ids_a_tokenizer_decodes_alike_are_named_by_id_where_they_meet():
    strings = TokenStrings(AliasTokenizer())
    top = ((1, -1.0), (5, -3.0))
    entries = [None, TokenLogprobs(2, -2.0, 2, top), TokenLogprobs(1, -1.0, 1, top)]
    out = completion_logprobs(strings, [2, 2, 1], entries, [0, 1, 2])
    assert out["tokens"] == ["\ufffd", "token_id:2", "\ufffd"]   # alike only where both are
    assert out["top_logprobs"][1:] == [{"token_id:1": -1.0, "<5>": -3.0, "token_id:2": -2.0},
                                       {"\ufffd": -1.0, "<5>": -3.0}]
    # a text that is itself another's fallback name: every id of that position by its id
    third = completion_logprobs(strings, [2], [TokenLogprobs(2, -2.0, 3, ((1, -1.0), (3, -1.5)))],
                                [0])
    assert third["tokens"] == ["token_id:2"]
    assert third["top_logprobs"] == [{"token_id:1": -1.0, "token_id:3": -1.5, "token_id:2": -2.0}]


def _check_entries(lp: dict, ids: list, k: int) -> None:
    """Each position: k + (chosen not among them) keys, one per distinct id, each its own."""
    assert lp["tokens"] == [byte_key(t) for t in ids]
    for i in range(1, len(ids)):
        top, token, value = lp["top_logprobs"][i], lp["tokens"][i], lp["token_logprobs"][i]
        assert top[token] == value
        assert len(top) in (k, k + 1) and len(top) == len(set(top))
        byte_pieces = [key for key in top if key.startswith("bytes:")]
        assert all(len(key) == len("bytes:\\xNN") for key in byte_pieces)


def test_served_completions_keep_k_distinct_tokens_streamed_and_not():
    """The tiny model's random weights with the byte tokenizer: its top 5 hold several bytes
    above 0x7F (each U+FFFD alone) at most positions, the echoed emoji's among them."""
    tok, k = byte_tokenizer(), 5
    body = {"prompt": EMOJI, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": k, "echo": True}
    with serving(VMEM, tokenizer=tok) as (server, _):
        done = local_http.post(server.url + "/v1/completions", json=body).json()["choices"][0]
        stream_body = {**body, "stream": True}
        with local_http.stream("POST", server.url + "/v1/completions", json=stream_body) as r:
            chunks = [json.loads(line[5:])["choices"][0] for line in r.iter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
    lp, ids = done["logprobs"], list(EMOJI.encode()) + done["token_ids"]
    _check_entries(lp, ids, k)
    high = sum(key.startswith("bytes:") for top in lp["top_logprobs"][1:] for key in top)
    assert high > len(ids)          # what had collapsed: more than one a position
    assert lp["text_offset"][:21] == list(range(13)) + [13] * 4 + [14] * 4
    streamed = {key: [v for c in chunks for v in c["logprobs"][key]] for key in lp}
    assert streamed == lp


def test_chat_top_logprobs_are_exactly_k_each_with_its_own_bytes():
    tok, k = byte_tokenizer(chat_template=True), 5
    body = {"messages": [{"role": "user", "content": EMOJI}], "max_completion_tokens": 8,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": k}
    with serving(VMEM, tokenizer=tok) as (server, _):
        answer = local_http.post(server.url + "/v1/chat/completions", json=body).json()
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["bytes"] for c in content] == [[t] for t in choice["token_ids"]]
    for c in content:
        tops = [t["bytes"] for t in c["top_logprobs"]]
        assert len(tops) == k and len({tuple(b) for b in tops}) == k
        own = [t["logprob"] for t in c["top_logprobs"] if t["bytes"] == c["bytes"]]
        assert own in ([], [c["logprob"]])
    assert any(t["token"] == "\ufffd" for c in content for t in c["top_logprobs"])
