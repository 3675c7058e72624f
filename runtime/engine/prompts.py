"""Prompts as the engine takes them: text (with a tokenizer) or token ids, checked."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .errors import RequestRejectedError


def encode_prompt(prompt, index: int, tokenizer,
                  vocab_size: int) -> Tuple[Tuple[int, ...], Optional[str]]:
    """(token ids, text or None) of one prompt: text through ``tokenizer``, or a sequence of
    int ids in ``[0, vocab_size)``. RequestRejectedError naming the prompt's ``index`` otherwise."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejectedError(f"prompt {index} is text but the engine has no "
                                       f"tokenizer; pass token ids or a tokenizer", index)
        ids = tuple(tokenizer(prompt)["input_ids"])
        text = prompt
    else:
        try:
            tokens = list(prompt)
        except TypeError:
            tokens = None
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool)
                                      for t in tokens):
            hint = "; pass prompt.tolist()" if isinstance(prompt, torch.Tensor) else ""
            raise RequestRejectedError(f"prompt {index} must be text or a sequence of int "
                                       f"token ids, got {str(prompt)[:60]!r}{hint}", index)
        ids, text = tuple(tokens), None
    if not ids:
        raise RequestRejectedError(f"prompt {index} is empty", index)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejectedError(f"prompt {index} has token ids {bad[:5]} outside the "
                                   f"vocabulary [0, {vocab_size})", index)
    return ids, text
