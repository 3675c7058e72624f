"""A Llama-3-style tokenizer (pre-tokenizer Sequence([Split(regex), ByteLevel(use_regex=False)]),
byte-level BPE, no normalizer) bounds a text's tokens as SmolLM2's plain ByteLevel does: the
Split keeps every character and ByteLevel turns each into at least one byte character, so a
too-long prompt is refused before it is tokenized (a 4 MiB chat message was tokenized first).
The bound is kept exact: a Split that removes characters, a pre-tokenizer after ByteLevel's
place that may drop some, a byte the vocabulary lacks, an added token that strips whitespace
give no bound, or count only what provably reaches a token. Built with ``tokenizers``: nothing
is downloaded."""
from __future__ import annotations

import functools

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vmemkv.runtime.engine.chat import chat_prompt_ids
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.text_bounds import check_text_fits, fewest_tokens, most_chars_per_token

from ..engine.byte_tokenizer import CHAT_TEMPLATE

# Llama-3's pre-tokenizer regex (tokenizer.json of Meta-Llama-3-8B)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LONGEST_TOKEN_CHARS = 4          # "xxxx"


class CountingTokenizer(PreTrainedTokenizerFast):
    """Counts the times it is asked to encode (a call, or a chat template rendered to ids)."""
    calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return super().encode(*args, **kwargs)


def byte_chars(text: str) -> str:
    """``text``'s UTF-8 bytes as the byte alphabet's characters (ByteLevel's own mapping)."""
    return pre_tokenizers.ByteLevel(use_regex=False).pre_tokenize_str(text)[0][0]


def llama3_style(split_behavior: str = "isolated", drop_bytes: str = "",
                 first: object = None) -> CountingTokenizer:
    """Every byte character (less the bytes of ``drop_bytes``), "xx" and "xxxx" as merges,
    ignore_merges as Llama-3's; ``first`` replaces the Split."""
    dropped = set(byte_chars(drop_bytes)) if drop_bytes else set()
    alphabet = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - dropped)
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"xx": len(vocab), "xxxx": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("x", "x"), ("xx", "xx")],
                               ignore_merges=True))
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior=split_behavior, invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        split if first is None else first,
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    fast = CountingTokenizer(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _tokens(tok, text: str) -> int:
    return len(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def test_a_split_then_byte_level_sequence_is_bounded_by_its_longest_token():
    tok = llama3_style()
    assert most_chars_per_token(tok) == LONGEST_TOKEN_CHARS
    assert most_chars_per_token(llama3_style(first=pre_tokenizers.Digits(True))) == 4
    for text in ("x" * 61, "x" * 64, "hello world, 日本語 🎉 x" * 7, "  \n\t123456 ''s xx", "é" * 9):
        assert _tokens(tok, text) >= fewest_tokens(text, tok), text     # a true lower bound
    assert _tokens(tok, "x" * 61) == fewest_tokens("x" * 61, tok) == 16  # and a tight one


def test_the_precheck_is_exact_at_the_limit_without_tokenizing():
    tok = llama3_style()
    limit = lambda tokens: 16        # noqa: E731 -- prompt + max_tokens the context allows
    check_text_fits("x" * 60, tok, limit, "prompt")   # 15 tokens ("xxxx" x 15) may fit
    with pytest.raises(ApiError) as refused:
        check_text_fits("x" * 61, tok, limit, "prompt")   # 16 tokens at least: 15 + "x"
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "at least 16 tokens" in refused.value.message, refused.value.message
    assert tok.calls == 0
    assert _tokens(tok, "x" * 61) == 16                   # what tokenizing it would have found


def test_a_4mib_chat_message_is_refused_before_the_template_tokenizes_it():
    tok = llama3_style()
    check = functools.partial(check_text_fits, tokenizer=tok, limit_for=lambda tokens: 64,
                              field="messages")
    with pytest.raises(ApiError) as refused:
        chat_prompt_ids(tok, [{"role": "user", "content": "x" * 4_000_000}],
                        check_text=check)
    assert refused.value.status == 400 and refused.value.param == "messages"
    # "<user>" + 4,000,000 characters + "\n<assistant>": 4,000,018 characters, 4 a token at most
    assert "at least 1000005 tokens" in refused.value.message, refused.value.message
    assert tok.calls == 0


@pytest.mark.parametrize("unbounded", [
    llama3_style(split_behavior="removed"),                            # drops what it matches
    llama3_style(first=pre_tokenizers.Whitespace()),                   # drops whitespace
    llama3_style(first=pre_tokenizers.CharDelimiterSplit("x")),       # drops every "x"
    llama3_style(drop_bytes="\u00a9"),    # its bytes c2 a9: a9, a continuation byte, unknown
], ids=["split-removed", "whitespace", "delimiter", "no-continuation-byte"])
def test_no_bound_where_characters_may_vanish(unbounded):
    assert most_chars_per_token(unbounded) is None
    check_text_fits("x" * 4_000, unbounded, lambda tokens: 16, "prompt")   # tokenized instead


def test_no_bound_past_byte_level_or_with_a_stripping_added_token():
    after = llama3_style()
    after.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(use_regex=False), pre_tokenizers.Whitespace()])
    assert most_chars_per_token(after) is None              # drops byte characters after it
    stripping = llama3_style()
    stripping.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert _tokens(stripping, " " * 40 + "<mask>") == 1     # 46 characters, one token
    assert most_chars_per_token(stripping) is None


@pytest.mark.parametrize("plain_byte_level", [False, True], ids=["llama3-style", "smollm2-style"])
def test_ascii_bytes_the_vocabulary_lacks_are_not_counted(plain_byte_level):
    tok = llama3_style(drop_bytes="\x04\x06")              # SmolLM2's vocabulary lacks these
    if plain_byte_level:                                    # SmolLM2's, GPT-2's pre-tokenizer
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = "a" + "\x04" * 100 + "\x06" * 20 + "b"
    assert _tokens(tok, text) == 2                          # the unknown bytes are dropped
    assert fewest_tokens(text, tok) == 1                    # ceil(2 counted characters / 4)
    check_text_fits(text, tok, lambda tokens: 3, "prompt")  # 2 tokens fit: no 400
