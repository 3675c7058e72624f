"""Logprobs in OpenAI's two shapes, from the engine's ``TokenLogprobs`` (the model's raw
distribution: ``runtime/engine/logprobs.py``).

    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{tok: lp}, ...],
                  "text_offset": [...]}     top: the k likeliest and the chosen token (vLLM's)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                  "logprob", "bytes"}, ...]}]}   top: exactly top_logprobs entries

A token's string is ``tokenizer.decode([id])`` (the token ids in decimal without a tokenizer);
a token holding part of a character decodes as U+FFFD there, and its ``bytes`` are those of
that string.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from vmemkv.runtime.engine.logprobs import TokenLogprobs


class TokenStrings:
    """Token id -> its string, memoised (a response names the same ids many times)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (str(token_id) if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text


def completion_logprobs(strings: TokenStrings, token_ids: Sequence[int],
                        entries: Sequence[Optional[TokenLogprobs]], text_offset: int = 0) -> dict:
    """The completions shape for ``token_ids`` (an entry None: a prompt's first token)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = strings(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top: dict = {}
        for t, lp in entry.top + ((entry.token_id, entry.logprob),):   # likeliest first: two
            top.setdefault(strings(t), lp)     # tokens with one string keep the likelier's value
        out["top_logprobs"].append(top)
    return out


def merge_completion_logprobs(parts: List[dict]) -> dict:
    """One completions logprobs object of consecutive parts (echoed prompt, then output)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out


def chat_logprobs(strings: TokenStrings, entries: Sequence[TokenLogprobs]) -> dict:
    """The chat shape: one content entry per generated token."""
    def one(token_id: int, logprob: float) -> dict:
        text = strings(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries]}
