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


def check_request_params(params, tokenizer, vocab_size: int, index: int) -> None:
    """RequestRejectedError naming the field when ``params`` asks for what this engine cannot
    give: stop strings without a tokenizer, a logit_bias on ids outside the vocabulary."""
    if params.stop and tokenizer is None:
        raise RequestRejectedError(f"prompt {index}: stop strings need a tokenizer and the engine "
                                   f"has none; use stop_token_ids", index, "stop")
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise RequestRejectedError(f"prompt {index}: logit_bias names token ids {bad[:5]} outside "
                                   f"the vocabulary [0, {vocab_size})", index, "logit_bias")
