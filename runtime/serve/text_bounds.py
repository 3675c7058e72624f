"""The fewest tokens a text can encode to, known without encoding it: a prompt too long for the
context is refused before the tokenizer spends seconds of CPU on it (a 4 MiB chat message took
6-8.5 s to tokenize into 1,000,030 tokens, only to be refused for its length).

A byte-level BPE tokenizer with no normalizer covers the text with its tokens and nothing
shrinks it first. Its pre-tokenizer is ByteLevel (SmolLM2's, GPT-2's), or a Sequence of
pre-tokenizers that only split the text (a Split that keeps every character: any behavior but
"removed"; Digits) ending in ByteLevel (Llama-3's: Split(regex) then ByteLevel(use_regex=False)):
either way every character of the text reaches the model as its UTF-8 bytes, each one a
character of the byte alphabet. The model is BPE with no subword prefix or suffix, so a
vocabulary token of k characters covers at most k byte characters; a byte its vocabulary lacks
is dropped (or, with an unknown token, fused with its neighbours into one), covered by no
vocabulary token. Every character past ASCII holds a continuation byte (0x80-0xBF): with all 64
of those in the vocabulary, each such character leaves at least one known byte character, as
does an ASCII character whose byte is known; the ASCII characters whose byte is unknown
(SmolLM2's vocabulary lacks 0x04, 0x06, ...: "a\\x04b" encodes to 2 tokens) leave none and are
not counted. An added (special) token covers its content (one that strips whitespace beside it
could cover any length: no bound). So with ``most_chars`` the longest token, a text of c
counted characters holds at least ceil(c / most_chars) tokens. Any other tokenizer (a
normalizer may shrink the text, a pre-tokenizer may drop characters, truncation may cut it)
gives no bound: its prompts are tokenized and checked as before.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Callable, Optional

from .errors import ApiError

_BOUNDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> _Bound or None
_LOCK = threading.Lock()
_KEEPS_EVERY_CHARACTER = ("isolated", "mergedwithprevious", "mergedwithnext", "contiguous")
_CONTINUATION_BYTES = range(0x80, 0xC0)


@dataclasses.dataclass(frozen=True)
class _Bound:
    most_chars: int          # the most byte characters (or added-token characters) a token covers
    dropped_chars: str       # the ASCII characters whose byte the vocabulary lacks: not counted


def most_chars_per_token(tokenizer) -> Optional[int]:
    """The most characters of text one token of ``tokenizer`` can cover, or None when no such
    bound holds (not a byte-level BPE fast tokenizer as the module docstring says)."""
    bound = _bound_of(tokenizer)
    return None if bound is None else bound.most_chars


def fewest_tokens(text: str, tokenizer) -> Optional[int]:
    """The fewest tokens ``text`` can encode to with ``tokenizer``, known without encoding it
    (the module docstring's bound); None when the tokenizer gives no bound."""
    bound = _bound_of(tokenizer)
    if bound is None:
        return None
    counted_chars = len(text) - sum(text.count(c) for c in bound.dropped_chars)
    return -(-counted_chars // bound.most_chars)


def _bound_of(tokenizer) -> Optional[_Bound]:
    """``tokenizer``'s bound, computed once per tokenizer (its vocabulary, tens of ms)."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):   # no backend to bound (or none)
        return None
    with _LOCK:
        if tokenizer in _BOUNDS:
            return _BOUNDS[tokenizer]
    bound = _bound(tokenizer)
    with _LOCK:
        _BOUNDS[tokenizer] = bound
    return bound


def _bound(tokenizer) -> Optional[_Bound]:
    from tokenizers import models

    backend = tokenizer.backend_tokenizer
    model = backend.model
    if backend.normalizer is not None or backend.truncation is not None \
            or not _splits_then_bytes(backend.pre_tokenizer) \
            or not isinstance(model, models.BPE) \
            or model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    known_bytes = {b for b, char in _byte_chars().items() if char in vocab}
    if not set(_CONTINUATION_BYTES) <= known_bytes:
        return None          # a character past ASCII could leave no byte the vocabulary knows
    if any(added.lstrip or added.rstrip
           for added in backend.get_added_tokens_decoder().values()):
        return None          # it covers the whitespace beside it too, of any length
    dropped = "".join(chr(b) for b in range(0x80) if b not in known_bytes)
    return _Bound(max(len(token) for token in vocab), dropped)


def _byte_chars() -> dict:
    """Byte -> the character of the byte alphabet standing for it, for the bytes text holds
    alone (ASCII) and the continuation bytes (the second of U+0080-U+00BF's two), as ByteLevel
    itself maps them."""
    from tokenizers import pre_tokenizers

    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str
    return {b: to_bytes(chr(b))[0][0][-1] for b in (*range(0x80), *_CONTINUATION_BYTES)}


def _splits_then_bytes(pre_tokenizer) -> bool:
    """True when ``pre_tokenizer`` is ByteLevel, or a Sequence of pre-tokenizers that keep
    every character (Split with any behavior but "removed", Digits) ending in ByteLevel."""
    from tokenizers import pre_tokenizers

    if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel):
        return True
    if not isinstance(pre_tokenizer, pre_tokenizers.Sequence):
        return False
    *splits, last = list(pre_tokenizer) or [None]     # its members (indexed until IndexError)
    return isinstance(last, pre_tokenizers.ByteLevel) and all(
        isinstance(s, pre_tokenizers.Digits) or (isinstance(s, pre_tokenizers.Split)
                                                 and s.behavior in _KEEPS_EVERY_CHARACTER)
        for s in splits)


def check_text_fits(text: str, tokenizer, limit_for: Callable[[int], int], field: str) -> None:
    """ApiError 400 naming ``field`` when ``text`` provably holds at least as many tokens as
    ``limit_for`` (a prompt's token count -> the most prompt + max_tokens it may ask for; never
    growing with the prompt) allows it: the 400 its tokens would get, without tokenizing it.
    Nothing when the tokenizer gives no bound or the text may fit."""
    fewest = fewest_tokens(text, tokenizer)
    if fewest is None:
        return
    limit = limit_for(fewest)
    if fewest >= limit:
        raise ApiError(400, f"this model's context is {limit} tokens; the prompt alone holds at "
                            f"least {fewest} tokens ({len(text):,} characters, at most "
                            f"{most_chars_per_token(tokenizer)} a token)", field)
