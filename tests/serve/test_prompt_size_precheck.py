"""A prompt provably too long for the context is refused before it is tokenized: a 4 MiB chat
message took 6-8.5 s of CPU to tokenize (1,000,030 tokens) only to be refused for its length.
A byte-level BPE tokenizer without normalizer covers at most its longest token's characters a
token, so a text of more characters than the context's tokens can cover is refused exactly
(the 400 naming ``prompt`` / ``messages`` its tokens would get); one character less is
tokenized and checked as before. Other tokenizers give no bound."""
from __future__ import annotations

import json

import pytest
from tokenizers import normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.text_bounds import check_text_fits, most_chars_per_token

from . import local_http
from ..engine.byte_tokenizer import CHAT_TEMPLATE, byte_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, serving

CONTEXT_TOKENS = VMEM["max_context"]          # 64: the served model's max_model_len
CHAT_FRAME_CHARS = len("<user>\n<assistant>")  # what CHAT_TEMPLATE adds around one user message


class CountingTokenizer(PreTrainedTokenizerFast):
    """The byte tokenizer (one token a UTF-8 byte), counting the times it is asked to encode."""
    calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


def counting_tokenizer() -> CountingTokenizer:
    backend = byte_tokenizer().backend_tokenizer
    tok = CountingTokenizer(tokenizer_object=backend.from_str(backend.to_str()))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_the_bound_is_the_longest_token_and_only_where_it_holds():
    assert most_chars_per_token(counting_tokenizer()) == 1      # one byte-level character each
    assert most_chars_per_token(None) is None
    assert most_chars_per_token(object()) is None
    normalized = counting_tokenizer()
    normalized.backend_tokenizer.normalizer = normalizers.Lowercase()   # could shrink text
    assert most_chars_per_token(normalized) is None
    dropping = counting_tokenizer()
    dropping.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # drops spaces
    assert most_chars_per_token(dropping) is None
    added = counting_tokenizer()
    added.add_special_tokens({"additional_special_tokens": ["<|a-long-special-token|>"]})
    assert most_chars_per_token(added) == len("<|a-long-special-token|>")


def test_the_precheck_is_exact_at_the_limit():
    tok = counting_tokenizer()
    check_text_fits("x" * 63, tok, lambda tokens: 64, "prompt")     # 63 tokens may fit: no 400
    with pytest.raises(ApiError) as refused:
        check_text_fits("x" * 64, tok, lambda tokens: 64, "prompt")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "at least 64 tokens" in refused.value.message, refused.value.message
    assert tok.calls == 0


def _post(server, path: str, body: dict):
    response = local_http.post(server.url + path, content=json.dumps(body),
                               headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


def test_too_long_prompts_are_refused_without_tokenizing_and_one_less_is_tokenized():
    tok = counting_tokenizer()
    with serving(VMEM, tokenizer=tok) as (server, engine):
        chat = lambda chars: {"messages": [{"role": "user", "content": "x" * chars}]}  # noqa: E731
        for path, body, param in (
                ("/v1/completions", {"prompt": "x" * CONTEXT_TOKENS, "max_tokens": 1}, "prompt"),
                ("/v1/completions", {"prompt": ["hi", "x" * 4_000_000], "max_tokens": 1},
                 "prompt"),
                ("/v1/chat/completions", chat(CONTEXT_TOKENS - CHAT_FRAME_CHARS), "messages"),
                ("/v1/chat/completions", chat(4_000_000), "messages")):
            status, answer = _post(server, path, body)
            assert status == 400 and answer["error"]["param"] == param, answer
            assert "at least" in answer["error"]["message"], answer
            assert tok.calls == 0, (path, tok.calls)        # refused before the tokenizer ran
        assert "prompt 1: " in _post(server, "/v1/completions", {
            "prompt": ["hi", "x" * 100], "max_tokens": 1})[1]["error"]["message"]
        status, answer = _post(server, "/v1/completions",
                               {"prompt": "x" * (CONTEXT_TOKENS - 1), "max_tokens": 1})
        assert status == 200 and answer["usage"]["prompt_tokens"] == CONTEXT_TOKENS - 1, answer
        status, answer = _post(server, "/v1/chat/completions",
                               dict(chat(CONTEXT_TOKENS - 1 - CHAT_FRAME_CHARS),
                                    max_completion_tokens=1))
        assert status == 200 and answer["usage"]["prompt_tokens"] == CONTEXT_TOKENS - 1, answer
        assert tok.calls == 2
        assert server.engine_thread.pending_requests == 0
        assert_memory_at_baseline(engine)
