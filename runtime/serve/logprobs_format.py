"""Logprobs in OpenAI's two shapes, from the engine's ``TokenLogprobs`` (the model's raw
distribution: ``runtime/engine/logprobs.py``).

    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{tok: lp}, ...],
                  "text_offset": [...]}     top: the k likeliest and the chosen token (vLLM's)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                  "logprob", "bytes"}, ...]}]}   top: exactly top_logprobs entries

A token's string is ``tokenizer.decode([id])`` (the token id in decimal without a tokenizer,
the text then being the ids with a space between two, which ``text_offset`` counts); a token
holding part of a character decodes as U+FFFD there. Its ``text_offset`` is where it starts in
the choice's text (``TextOffsets``): the length of the text its predecessors decode to, so a
token inside a character split over tokens points at that character, never past the text.
Its ``bytes`` are the token's own (as OpenAI's: a character split over tokens is rebuilt by
joining them) where the tokenizer says what they are: a byte-level BPE's pieces (GPT-2's byte
alphabet), a byte-fallback piece (``<0xE2>``); else the UTF-8 of its string.

Completions name a token (``tokens``, ``top_logprobs``' keys) by ``TokenStrings.key``: its
string where its bytes are whole characters, else OpenAI's ``bytes:\\xNN...`` of its bytes, so
the byte pieces of an emoji, each U+FFFD, are told apart; where two ids of one position still
share a key, each is named ``token_id:N`` there (vLLM's form): k distinct tokens are k keys,
each holding its own token's logprob (keyed by string, the likelier's value stood under both).
"""
from __future__ import annotations

import functools
import json
import re
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

from vmemkv.runtime.engine.detokenize import REPLACEMENT
from vmemkv.runtime.engine.logprobs import TokenLogprobs


class TokenStrings:
    """Token id -> its string, memoised (a response names the same ids many times)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self._cache = tokenizer, {}
        self._bytes: dict = {}
        self._keys: Dict[int, str] = {}
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

    def key(self, token_id: int) -> str:
        """How completions name the token (module docstring), memoised: its string where its
        bytes (``token_bytes``) are whole UTF-8 characters, else ``bytes:`` and each byte as
        ``\\xNN`` (OpenAI's legacy form: "bytes:\\xf0\\x9f" for an emoji's first two)."""
        key = self._keys.get(token_id)
        if key is None:
            raw = bytes(self.token_bytes(token_id))
            try:
                raw.decode("utf-8")
                key = self(token_id)
            except UnicodeDecodeError:
                key = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._keys[token_id] = key
        return key

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


class TextOffsets:
    """``text_offset`` of one sequence's tokens, one ``add`` per token, from ``start_chars`` on:
    where it starts in the text it decodes with the tokens before it: their text as far as it
    leaves it, less a U+FFFD run that still ends the text (a token that continues a character
    split over tokens, U+FFFD alone, points at that character; a U+FFFD it leaves behind, a
    broken character, as after a prompt of token ids that ended inside one, is text it starts
    after), so the offsets never go back and never pass the text. A token that starts a
    character right after a broken one reads, until that character is whole, as part of one
    trailing U+FFFD run (in text the same as one partial character: a byte-fallback tokenizer
    decodes e6 97 as two U+FFFD), so it points at the run's start. The engine's detokenizer's
    windows (``runtime/engine/detokenize.py``): each token decodes a few tokens, never the
    prefix.

        "Emoji party: 🎉🎉"  Em  oji  ␣party  :   ␣F0 9F  8E  89  F0 9F  8E  89   (SmolLM2's)
        text_offset          0   2     5     11    12    13  13    14  14  14

    Without a tokenizer a token's string is its id in decimal and a space follows each."""

    def __init__(self, tokenizer, start_chars: int = 0, skip_special_tokens: bool = False) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.chars = start_chars       # text of the tokens up to the window's unread ones
        self._last_offset = start_chars
        self._ids: List[int] = []      # the window: context tokens, then unread ones
        self._read = 0                 # the window's first unread token

    def add(self, token_id: int) -> int:
        """The offset of ``token_id``, the sequence's next token."""
        if self.tokenizer is None:
            offset = self._last_offset = max(self._last_offset, self.chars)
            self.chars += len(str(token_id)) + 1
            return offset
        before = self._decode(self._ids)          # the window before this token
        self._ids.append(token_id)
        shown = self._decode(self._ids[:self._read])
        full = self._decode(self._ids)
        starts = min(_common_prefix_chars(before, full), len(full.rstrip(REPLACEMENT)))
        offset = self._last_offset = max(self._last_offset, self.chars + starts - len(shown))
        if len(full) > len(shown) and not full.endswith(REPLACEMENT):
            self.chars += len(full) - len(shown)
            del self._ids[:self._read]        # the tokens just read are the next context
            self._read = len(self._ids)
        return offset

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)


def _common_prefix_chars(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` start with alike."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class StreamedTokens:
    """One streamed choice's output tokens, each with its ``text_offset``, sent with the chunk
    that sends the character the token starts at: the engine holds text back while it may be
    the start of a stop string (``runtime/engine/detokenize.py``), and a token is held with it
    (one that adds no character, a skipped special token, waits for the next that does). The
    last chunk sends every token held, its offset cut at the text's end as
    ``CompletionFormat.choice`` cuts, so the entries streamed are the non-streamed ones, in
    order, and never point past the text sent so far (``sent_chars``: the echo's included)."""

    def __init__(self, offsets: TextOffsets) -> None:
        self.offsets = offsets
        self.sent_chars = 0
        self._held: List[Tuple[int, Optional[TokenLogprobs], int]] = []   # (id, entry, offset)

    def send(self, text: str, token_ids: Sequence[int],
             entries: Sequence[Optional[TokenLogprobs]], last: bool
             ) -> Tuple[List[int], List[Optional[TokenLogprobs]], List[int]]:
        """The token ids, entries and offsets a chunk of ``text`` (all of it, an echo too)
        carries; ``token_ids`` and ``entries``: the tokens the engine gave with that text;
        ``last``: the choice ends with it, so every held token goes."""
        self.sent_chars += len(text)
        self._held += zip(token_ids, entries, [self.offsets.add(t) for t in token_ids],
                          strict=True)
        ready = len(self._held)      # the offsets only grow: the first not sent holds the rest
        if not last:
            ready = next((i for i, (_, _, offset) in enumerate(self._held)
                          if offset >= self.sent_chars), ready)
        out, self._held = self._held[:ready], self._held[ready:]
        return ([t for t, _, _ in out], [e for _, e, _ in out],
                [min(offset, self.sent_chars) for _, _, offset in out])


def echo_offsets(tokenizer, token_ids: Sequence[int], echo: str) -> List[int]:
    """A prompt's ``text_offset`` in its ``echo`` (the prompt as sent, or its ids decoded with
    special tokens): ``TextOffsets``' less what the decoded ids hold in front of the echo (a
    BOS the tokenizer adds, ``<s>``), within ``[0, len(echo)]``."""
    offsets = TextOffsets(tokenizer)
    found = [offsets.add(t) for t in token_ids]
    if tokenizer is None:
        return found
    decoded = tokenizer.decode(list(token_ids), skip_special_tokens=False)
    before = len(decoded) - len(echo) if decoded.endswith(echo) else 0
    return [min(max(o - before, 0), len(echo)) for o in found]


def completion_logprobs(strings: TokenStrings, token_ids: Sequence[int],
                        entries: Sequence[Optional[TokenLogprobs]],
                        text_offsets: Sequence[int]) -> dict:
    """The completions shape for ``token_ids`` (an entry None: a prompt's first token) at
    ``text_offsets`` (``TextOffsets``, ``echo_offsets``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry, text_offset in zip(token_ids, entries, text_offsets):
        out["text_offset"].append(text_offset)
        if entry is None:
            out["tokens"].append(strings.key(token_id))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        keys = _position_keys(strings, [t for t, _ in entry.top] + [entry.token_id])
        top = {keys[t]: lp for t, lp in entry.top}     # likeliest first, then the chosen
        top[keys[entry.token_id]] = entry.logprob
        out["tokens"].append(keys[entry.token_id])
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append(top)
    return out


def _position_keys(strings: TokenStrings, token_ids: Sequence[int]) -> Dict[int, str]:
    """Each distinct id of one position (its top k and the chosen) -> its own key: its
    ``strings.key``, or ``token_id:N`` where another id there has that key too (two tokens a
    tokenizer decodes alike whose bytes it does not tell: two partial characters, each U+FFFD,
    of a tokenizer without byte pieces), so no key names two tokens."""
    keys = {t: strings.key(t) for t in token_ids}
    shared = Counter(keys.values())
    named = {t: key if shared[key] == 1 else f"token_id:{t}" for t, key in keys.items()}
    if len(set(named.values())) < len(named):     # a token whose text is "token_id:N" itself
        return {t: f"token_id:{t}" for t in keys}
    return named


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


@functools.lru_cache(maxsize=8)
def longest_token_json(tokenizer, vocab_size: int):
    """(S, B, N) of ``limits.ResponseBounds``, measured once per tokenizer: the longest JSON
    string of a token's text, its bytes as ``TokenStrings.token_bytes`` counts them, and of its
    text or completions' name of it (``key``: "bytes:\\xNN" for part of a character, "token_id:N"
    where two share one)."""
    strings, ids = TokenStrings(tokenizer), list(range(vocab_size))
    texts = [strings(i) for i in ids]
    names = [strings.key(i) for i in ids] + [f"token_id:{max(vocab_size - 1, 0)}"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    s, n = (max(len(json.dumps(t, ensure_ascii=False).encode()) - 2 for t in group)
            for group in (texts, texts + names))
    return s, max(max(len(p or ""), len(t.encode())) for p, t in zip(pieces, texts)), n
