"""One choice's text as its tokens stream in: incremental decoding and stop strings.

With a tokenizer the text is ``tokenizer.decode(token_ids, skip_special_tokens=True)`` (what
``Engine`` puts in ``CompletionOutput.text``); without one it is the token ids in decimal,
space-separated (what ``vmemkv generate`` prints). A stop string ends the choice with
finish_reason "stop" and is not part of the text; while stop strings are asked for, the last
``longest stop - 1`` characters are held back, so a streamed delta never shows the start of a
stop string that the next token completes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


class ChoiceText:
    """Text of one choice; ``add`` returns the delta the client may see now."""

    def __init__(self, tokenizer=None, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.token_ids: List[int] = []
        self.text = ""            # what the client has been sent
        self.finish_reason: Optional[str] = None
        self.cut = False          # a stop string ended it (the engine may still be generating)
        self._hold_chars = max((len(s) for s in self.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int, finish_reason: Optional[str]) -> Tuple[str, List[int]]:
        """Take one token (``finish_reason`` set on the choice's last); returns (text delta,
        token ids delta). After a stop string, further tokens are ignored."""
        if self.finished:
            return "", []
        self.token_ids.append(token_id)
        full = self._decode()
        cut = self._stop_at(full)
        if cut is not None:
            full, finish_reason, self.cut = full[:cut], "stop", True
        shown = len(full) if finish_reason else max(len(self.text), len(full) - self._hold_chars)
        delta = full[len(self.text):shown]
        self.text += delta
        self.finish_reason = finish_reason
        return delta, [token_id]

    def _decode(self) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, self.token_ids))
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _stop_at(self, full: str) -> Optional[int]:
        """Where the first stop string starts in ``full`` (None when none is there)."""
        start = max(0, len(self.text) - self._hold_chars)
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None
