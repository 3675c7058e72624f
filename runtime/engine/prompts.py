"""Prompts as the engine takes them: text (with a tokenizer) or token ids, checked.

A prompt is a ``str`` or a ``list`` / ``tuple`` of Python ints. Everything else is refused with
its type named, never read as something it is not: bytes (whose items are ints, but byte
values, not token ids), a dict (whose iteration gives its keys), a generator or iterator (it
would be consumed by the check), a set (no order), a numpy array or a torch tensor (pass
``.tolist()``; a 2-D one is a batch, not a prompt). A batch of prompts (``generate``) is a
``list`` or ``tuple`` of prompts.
"""
from __future__ import annotations

from typing import Optional, Tuple

from .errors import EngineConfigError, RequestRejectedError

_ARRAYS = {"ndarray": "numpy array", "Tensor": "tensor"}   # known without importing them


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` is Unicode text: JSON's escapes (or Python's) can make a lone surrogate,
    which no tokenizer takes (the Rust tokenizers raise a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def encode_prompt(prompt, index: int, tokenizer,
                  vocab_size: int) -> Tuple[Tuple[int, ...], Optional[str]]:
    """(token ids, text or None) of one prompt: text through ``tokenizer``, or a list / tuple
    of int ids in ``[0, vocab_size)``. RequestRejectedError naming the prompt's ``index`` otherwise."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestRejectedError(f"prompt {index} is text but the engine has no "
                                       f"tokenizer; pass token ids or a tokenizer", index)
        if not is_unicode_text(prompt):
            raise RequestRejectedError(f"prompt {index} holds a lone surrogate (\\ud800-\\udfff "
                                       f"without its pair): not Unicode text", index)
        ids = tuple(tokenizer(prompt)["input_ids"])
        text = prompt
    else:
        ids, text = _token_ids(prompt, index), None
    if not ids:
        raise RequestRejectedError(f"prompt {index} is empty", index)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejectedError(f"prompt {index} has token ids {bad[:5]} outside the "
                                   f"vocabulary [0, {vocab_size})", index)
    return ids, text


def _token_ids(prompt, index: int) -> Tuple[int, ...]:
    kind = type(prompt).__name__
    if kind in _ARRAYS:
        shape = tuple(getattr(prompt, "shape", ()))
        what = "; 2-D is a batch of prompts, not one" if len(shape) > 1 else ""
        raise RequestRejectedError(f"prompt {index} must be text or a list of int token ids, "
                                   f"got a {_ARRAYS[kind]} of shape {shape}{what}; pass "
                                   f"prompt.tolist()", index)
    if not isinstance(prompt, (list, tuple)):
        hint = {"bytes": "; bytes are not token ids: decode them to text",
                "bytearray": "; bytes are not token ids: decode them to text",
                "dict": "; a dict iterates over its keys"}.get(kind, "")
        raise RequestRejectedError(f"prompt {index} must be text or a list of int token ids, "
                                   f"got a {kind}{hint}", index)
    bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
    if bad:
        raise RequestRejectedError(f"prompt {index} must be text or a list of int token ids, "
                                   f"got {type(bad[0]).__name__} {str(bad[0])[:40]!r} in it",
                                   index)
    return tuple(prompt)


def check_prompt_batch(prompts) -> None:
    """EngineConfigError unless ``prompts`` is a list / tuple of prompts (``generate`` and
    ``stream`` take a batch): one flat prompt, a string, an array or a generator is refused."""
    kind = type(prompts).__name__
    if kind in _ARRAYS:
        raise EngineConfigError(f"prompts must be a list of prompts (token-id lists or strings), "
                                f"got a {_ARRAYS[kind]} of shape "
                                f"{tuple(getattr(prompts, 'shape', ()))}; pass prompts.tolist()")
    if not isinstance(prompts, (list, tuple)):
        raise EngineConfigError(f"prompts must be a list of prompts (token-id lists or strings), "
                                f"got a {kind}" + ("; pass list(prompts)" if hasattr(prompts, "__next__")
                                                   else ""))
    if prompts and isinstance(prompts[0], int):
        raise EngineConfigError("prompts must be a list of prompts (token-id lists or strings)")


def check_request_params(params, tokenizer, vocab_size: int, index: int) -> None:
    """RequestRejectedError naming the field when ``params`` asks for what this engine cannot
    give: stop strings without a tokenizer, a logit_bias or stop_token_ids on ids outside the
    vocabulary."""
    if params.stop and tokenizer is None:
        raise RequestRejectedError(f"prompt {index}: stop strings need a tokenizer and the engine "
                                   f"has none; use stop_token_ids", index, "stop")
    for field, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                       ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]    # (a stop id past it could never match)
        if bad:
            raise RequestRejectedError(f"prompt {index}: {field} names token ids {bad[:5]} "
                                       f"outside the vocabulary [0, {vocab_size})", index, field)
