"""The fewest tokens a text can encode to, known without encoding it: a prompt too long for the
context is refused before the tokenizer spends seconds of CPU on it (a 4 MiB chat message took
6-8.5 s to tokenize into 1,000,030 tokens, only to be refused for its length).

A byte-level BPE tokenizer with no normalizer (SmolLM2's, GPT-2's) covers the text with its
tokens and nothing shrinks it first: a vocabulary token of k characters (one per byte) covers
at most k characters of the text, an added (special) token its content. So with
``most_chars`` the longest of them, a text of c characters holds at least ceil(c / most_chars)
tokens. Any other tokenizer (a normalizer may shrink the text, a pre-tokenizer may drop
characters, truncation may cut it) gives no bound: its prompts are tokenized and checked as
before.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

from .errors import ApiError

_MOST_CHARS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> bound
_LOCK = threading.Lock()


def most_chars_per_token(tokenizer) -> Optional[int]:
    """The most characters of text one token of ``tokenizer`` can cover, or None when no such
    bound holds (not a byte-level BPE fast tokenizer without normalizer and truncation).
    Computed once per tokenizer (its vocabulary, tens of milliseconds)."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):   # no backend to bound (or none)
        return None
    with _LOCK:
        if tokenizer in _MOST_CHARS:
            return _MOST_CHARS[tokenizer]
    bound = _bound(tokenizer)
    with _LOCK:
        _MOST_CHARS[tokenizer] = bound
    return bound


def _bound(tokenizer) -> Optional[int]:
    from tokenizers import models, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None or backend.truncation is not None \
            or not isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel) \
            or not isinstance(backend.model, models.BPE):
        return None
    return max(len(token) for token in backend.get_vocab(with_added_tokens=True))


def check_text_fits(text: str, tokenizer, limit_for: Callable[[int], int], field: str) -> None:
    """ApiError 400 naming ``field`` when ``text`` provably holds at least as many tokens as
    ``limit_for`` (a prompt's token count -> the most prompt + max_tokens it may ask for; never
    growing with the prompt) allows it: the 400 its tokens would get, without tokenizing it.
    Nothing when the tokenizer gives no bound or the text may fit."""
    most_chars = most_chars_per_token(tokenizer)
    if most_chars is None:
        return
    fewest_tokens = -(-len(text) // most_chars)
    limit = limit_for(fewest_tokens)
    if fewest_tokens >= limit:
        raise ApiError(400, f"this model's context is {limit} tokens; the prompt alone holds at "
                            f"least {fewest_tokens} tokens ({len(text):,} characters, at most "
                            f"{most_chars} a token)", field)
