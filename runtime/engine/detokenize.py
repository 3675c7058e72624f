"""One sample's text as its tokens arrive: incremental detokenization and stop strings.

A token is a piece of a UTF-8 byte string, so decoding the tokens so far can end in half a
character (U+FFFD). As vLLM's detokenizer does, the text grows only when the decoded tail is
complete: two offsets into the sample's tokens, ``prefix`` (context, already shown) and
``read`` (first token not yet shown); each token decodes ``tokens[prefix:]`` and
``tokens[prefix:read]`` and, unless the first ends in U+FFFD, appends what it adds. Each step
decodes a few tokens, never the whole output.

    tokens  ... | 日 (2 tokens: e6 97, a5) | ...
    after e6 97     decode -> "...\\ufffd"   held back (nothing shown)
    after a5        decode -> "...日"        "日" appended, offsets move past it

Stop strings are searched in the text; while they are asked for, the last ``longest - 1``
characters are held back, so a delta never shows the start of a stop string the next token
completes. The sample's ``text`` ends at the first stop string (kept with
``include_stop_str_in_output``). On the sample's last token everything is flushed: the text is
then ``tokenizer.decode(tokens, skip_special_tokens=...)`` cut at the first stop string, looked
for before the U+FFFD that ends it where the last tokens leave a character incomplete (that
stands for bytes the model did not finish: a stop string "\ufffd" never turns a sample that
max_tokens cut mid-character into a "stop"; a U+FFFD the model wrote last reads the same).

``min_tokens``, as vLLM: no stop string is looked for while the sample has at most
``min_tokens`` tokens, and a stop string found later must end after the text those tokens
decoded to (one that was complete by then does not count). The held-back characters stay held,
so a stop string that starts within the first ``min_tokens`` tokens and ends after them is found.

A tokenizer whose ``decode`` raises, or returns anything but a str, on a request's tokens while
its step is recorded fails that request alone (``TokenDecodeError`` naming it and the tokens;
lifecycle.py): the step is undone, the request ends "failed" and the others' tokens are
computed again. Where a request ends early, its text is what was shown (``decode_at_end``).
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

from .errors import EngineError

REPLACEMENT = "\ufffd"
SHOWN_TOKENS = 8   # a TokenDecodeError lists at most the last 8 token ids it decoded
T = TypeVar("T")
log = logging.getLogger("vmemkv.engine")


class TokenDecodeError(EngineError, ValueError):
    """The tokenizer's ``decode`` raised, or returned no str, on request ``request_id``'s output
    token ids ``token_ids`` (``token_id``: the last of them; decoding a sample's new token, its
    newest) while its step was recorded: that request ends "failed" with it
    (``RequestOutput.error``), the others go on: a step never raises it."""

    def __init__(self, message: str, request_id: Optional[int], token_ids: Sequence[int]) -> None:
        super().__init__(message)
        self.request_id, self.token_ids = request_id, tuple(token_ids)
        self.token_id = self.token_ids[-1] if self.token_ids else None


def decode_tokens(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool,
                  request_id: Optional[int]) -> str:
    """``tokenizer.decode(token_ids)``, checked: TokenDecodeError naming ``request_id`` and the
    ids when the tokenizer raises (its exception chained) or returns anything but a str."""
    ids = list(token_ids)
    try:
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    except Exception as error:   # noqa: BLE001 -- the tokenizer's own, named and chained
        raise TokenDecodeError(_decode_failure(request_id, ids, f"raised {type(error).__name__}: "
                                               f"{error}"), request_id, ids) from error
    if not isinstance(text, str):
        raise TokenDecodeError(_decode_failure(request_id, ids, f"returned {type(text).__name__}"
                                               f", not a str"), request_id, ids)
    return text


def _decode_failure(request_id: Optional[int], ids: List[int], what: str) -> str:
    shown = ("..., " if len(ids) > SHOWN_TOKENS else "") + ", ".join(map(str, ids[-SHOWN_TOKENS:]))
    last = f", ending with token {ids[-1]}" if ids else ""
    whose = "" if request_id is None else f"request {request_id}: "
    return (f"{whose}the tokenizer's decode of output token ids [{shown}] ({len(ids)} ids{last}) "
            f"{what}; the text of these tokens cannot be computed")


def decode_at_end(decode: Callable[[], T]) -> Optional[T]:
    """``decode()`` where a sample or beam request ends early (aborted, failed, closed), or None
    when the tokenizer raises: an ending never fails on its text (its status, tokens and the
    memory it releases do not depend on it, and ``close`` must release everything); the error
    is logged and the text stays what was shown before."""
    try:
        return decode()
    except Exception as error:   # noqa: BLE001 -- the tokenizer's own, logged
        log.warning("a request's text was not finished: the tokenizer's decode raised %s: %s",
                    type(error).__name__, error)
        return None


class IncrementalText:
    """Text of one sample; ``add`` takes a token and returns the delta a client may see now."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0,
                 request_id: Optional[int] = None) -> None:
        self.tokenizer, self.stop, self.include_stop = tokenizer, tuple(stop), include_stop
        self.skip_special_tokens, self.min_tokens = skip_special_tokens, min_tokens
        self.request_id = request_id   # named by a TokenDecodeError
        self.token_ids: List[int] = []
        self.text = ""              # what has been shown (the deltas so far)
        self.stopped_by: Optional[str] = None   # the stop string that ended the text
        self._decoded = ""          # complete characters decoded so far
        self._prefix = self._read = 0
        self._min_tokens_chars = 0  # len(_decoded) after the first min_tokens tokens: a stop
                                    # string must end beyond it
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.stopped_by is not None

    def add(self, token_id: int, last: bool = False) -> str:
        """Take the sample's next token (``last``: it ends the sample, flush everything).
        After a stop string, further tokens change nothing and return "". TokenDecodeError when
        the tokenizer cannot decode them (``restore`` a ``save`` from before to undo it)."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        self._advance()
        if last:
            self._flush()
        return self._show(last)

    def finish(self) -> str:
        """Flush what is held (the sample ended without a new token: aborted, failed, closed);
        a tokenizer that raises leaves what was decoded before (``decode_at_end``)."""
        if self.stopped:
            return ""
        decode_at_end(self._flush)   # changes nothing when a decode raises
        return self._show(True)

    def save(self) -> tuple:
        """What ``add`` and ``finish`` change, for ``restore`` (a step that was not recorded)."""
        return (len(self.token_ids), self.text, self.stopped_by, self._decoded, self._prefix,
                self._read, self._min_tokens_chars)

    def restore(self, saved: tuple) -> None:
        (tokens, self.text, self.stopped_by, self._decoded, self._prefix, self._read,
         self._min_tokens_chars) = saved
        del self.token_ids[tokens:]

    def _decode(self, ids: Sequence[int]) -> str:
        return decode_tokens(self.tokenizer, ids, self.skip_special_tokens, self.request_id)

    def _advance(self) -> None:
        ids = self.token_ids
        shown = self._decode(ids[self._prefix:self._read])
        full = self._decode(ids[self._prefix:])
        if len(full) > len(shown) and not full.endswith(REPLACEMENT):
            self._decoded += full[len(shown):]
            self._prefix, self._read = self._read, len(ids)

    def _flush(self) -> None:
        """Everything decoded, as one decode of all tokens when that extends what was shown."""
        whole = self._decode(self.token_ids)
        if whole.startswith(self._decoded):
            self._decoded = whole
        else:   # a tokenizer whose windows decode differently: keep the shown text's prefix
            self._decoded += self._decode(self.token_ids[self._read:])
        self._prefix = self._read = len(self.token_ids)

    def _show(self, last: bool) -> str:
        # flushed, the text may end in U+FFFD standing for a character the last token left
        # incomplete (max_tokens cut it): no stop string matches what the model never wrote
        cut = self._stop_at(len(self._decoded.rstrip(REPLACEMENT)) if last else len(self._decoded))
        if cut is not None:
            end, self.stopped_by = cut
        else:
            end = len(self._decoded) if last else len(self._decoded) - self._hold
        delta = self._decoded[len(self.text):max(end, len(self.text))]
        self.text += delta
        return delta

    def _stop_at(self, written_chars: int) -> Optional[Tuple[int, str]]:
        """Where the text ends at the first stop string within its first ``written_chars``, and
        that string (None: none yet, or the sample has at most ``min_tokens`` tokens). One starts
        at or after the shown text (one starting earlier would have been found before) and ends
        after ``_min_tokens_chars``."""
        if len(self.token_ids) <= self.min_tokens:
            self._min_tokens_chars = len(self._decoded)
            return None
        shown, after = len(self.text), self._min_tokens_chars
        hits = [(i, s) for i, s in ((self._decoded.find(s, max(shown, after - len(s) + 1),
                                                         written_chars), s)
                                    for s in self.stop) if i >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        return (at + len(stop) if self.include_stop else at), stop
