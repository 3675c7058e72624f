"""Checks of what a caller hands the engine's public calls besides its configuration: the
tokenizer, callbacks, request ids, counts and lists. Each raises EngineConfigError naming the
argument, before anything is built, queued or changed (a wrong type was taken and failed
later: a step ran, a request was left running, or another id was read)."""
from __future__ import annotations

from .errors import EngineConfigError


def check_tokenizer(tokenizer) -> None:
    """``tokenizer`` is None or does the two things the engine asks of one: a call that encodes
    text (``tokenizer(text)["input_ids"]``: prompts.py) and ``decode(ids,
    skip_special_tokens=...)`` (detokenize.py). A transformers tokenizer does both; a name
    (``"gpt2"``) does neither (load it first: ``AutoTokenizer.from_pretrained("gpt2")``)."""
    if tokenizer is None:
        return
    lacking = [what for what, ok in (
        ("a call that encodes text (tokenizer(text)['input_ids'])", callable(tokenizer)),
        ("a decode(ids, skip_special_tokens=...) method",
         callable(getattr(tokenizer, "decode", None)))) if not ok]
    if lacking:
        hint = (f"; load it first, e.g. AutoTokenizer.from_pretrained({tokenizer!r})"
                if isinstance(tokenizer, str) else "")
        raise EngineConfigError(f"tokenizer must be None or a tokenizer (a transformers one), got "
                                f"{type(tokenizer).__name__} {str(tokenizer)[:60]!r}, which lacks "
                                f"{' and '.join(lacking)}{hint}")


def check_callback(name: str, callback, required: bool = False) -> None:
    """``callback`` (the argument ``name``: ``on_token``, ``on_step``, add_all's ``add``) is
    callable, or None unless ``required``."""
    if not callable(callback) and (required or callback is not None):
        raise EngineConfigError(f"{name} must be callable{'' if required else ' or None'}, got "
                                f"{callback!r}")


def check_count(name: str, count) -> None:
    """``count`` (the argument ``name``) is an int >= 0: not a bool, float or numpy integer."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise EngineConfigError(f"{name} must be an int >= 0, got {type(count).__name__} "
                                f"{repr(count)[:60]}")


def check_list_of(name: str, values, kind: type, what: str) -> None:
    """``values`` (the argument ``name``) is a list or tuple of ``kind``; ``what`` says where
    such values come from."""
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, kind) for v in values):
        raise EngineConfigError(f"{name} must be a list of {kind.__name__} ({what}), got "
                                f"{type(values).__name__} {repr(values)[:60]}")


def check_request_id(request_id) -> None:
    """A request id is an ``int``, as ``add_request`` returns it: not a bool (``True`` read as
    request 1), a float (``1.0`` likewise) or a numpy integer (refused as token ids of that type
    are in a prompt: pass ``int(request_id)``)."""
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise EngineConfigError(f"request_id must be an int (as add_request returns it), got "
                                f"{type(request_id).__name__} {str(request_id)[:60]!r}")
