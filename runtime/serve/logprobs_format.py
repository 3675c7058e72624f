"""Logprobs in OpenAI's two shapes, from the engine's ``TokenLogprobs`` (the model's raw
distribution: ``runtime/engine/logprobs.py``).

    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{tok: lp}, ...],
                  "text_offset": [...]}     top: the k likeliest and the chosen token (vLLM's)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                  "logprob", "bytes"}, ...]}]}   top: exactly top_logprobs entries

A token's string is ``tokenizer.decode([id])`` (the token id in decimal without a tokenizer,
the text then being the ids with a space between two, which ``text_offset`` counts); a token
holding part of a character decodes as U+FFFD there. Its ``bytes`` are the token's own (as
OpenAI's: a character split over tokens is rebuilt by joining them) where the tokenizer says
what they are: a byte-level BPE's pieces (GPT-2's byte alphabet), a byte-fallback piece
(``<0xE2>``); else the UTF-8 of its string.
"""
from __future__ import annotations

import re
from typing import List, Optional, Sequence

from vmemkv.runtime.engine.logprobs import TokenLogprobs


class TokenStrings:
    """Token id -> its string, memoised (a response names the same ids many times)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self._cache = tokenizer, {}
        self.separator = " " if tokenizer is None else ""   # between two tokens' strings
        self._bytes: dict = {}
        self._decoder: Optional[str] = None if tokenizer is not None else "text"

    def token_bytes(self, token_id: int) -> List[int]:
        """The token's own bytes (module docstring), memoised."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self._raw_bytes(token_id))
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        if self._decoder is None:
            self._decoder = _decoder_kind(self.tokenizer)
        if self._decoder != "text":
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self._decoder == "byte-level" and isinstance(piece, str) \
                    and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece or "")
            if self._decoder == "byte-fallback" and match:
                return bytes([int(match.group(1), 16)])
        return self(token_id).encode("utf-8")

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (str(token_id) if self.tokenizer is None
                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text


def _gpt2_byte_alphabet() -> dict:
    """GPT-2's bytes_to_unicode, inverted: the printable character that stands for each byte
    in a byte-level BPE's pieces -> the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_OF_CHAR = _gpt2_byte_alphabet()


def _decoder_kind(tokenizer) -> str:
    """How a tokenizer's pieces map to bytes: "byte-level", "byte-fallback" or "text"."""
    decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
    return ("byte-level" if "ByteLevel(" in decoder else
            "byte-fallback" if "ByteFallback(" in decoder else "text")


def completion_logprobs(strings: TokenStrings, token_ids: Sequence[int],
                        entries: Sequence[Optional[TokenLogprobs]], text_offset: int = 0) -> dict:
    """The completions shape for ``token_ids`` (an entry None: a prompt's first token)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = strings(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text) + len(strings.separator)
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
        return {"token": strings(token_id), "logprob": logprob,
                "bytes": strings.token_bytes(token_id)}
    return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries]}
