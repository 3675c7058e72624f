"""Chat conversations as prompts: OpenAI-style messages rendered by the tokenizer's chat template.

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
      -> tokenizer.apply_chat_template(messages, add_generation_prompt=True) -> token ids

A message is a dict with ``role`` (system, developer, user or assistant; ``developer``, OpenAI's
newer name for system, reaches the template as "system": every template renders that one, and
one that does not know "developer" would render a role the model never saw or drop it; a
``tool`` or ``function`` message is refused: tool calls are not supported) and ``content``: a string, or a
list of OpenAI content parts ``{"type": "text", "text": ...}`` (their texts joined with "\n", as
vLLM's and TensorRT-LLM's), and optionally ``name`` (handed to the template, which may render
it); any other key (``tool_calls``, a part's ``cache_control``, ...) or part type
(``image_url``, ...) is refused by name, never dropped. The template is the tokenizer's own (a
GGUF file carries one, as ``tokenizer.chat_template``; of a dict of named templates, its
"default", as transformers picks) unless ``chat_template`` overrides it (a Jinja template, or
the name of one of the tokenizer's); a model without one (the random-weight built-ins) is
refused with ``ChatTemplateError``, as is a template that is empty or fails to render (a dict
with no "default", the names it has). Nothing is queued before every conversation has rendered.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from .errors import RequestRejectedError
from .prompts import is_unicode_text

ROLES = ("system", "developer", "user", "assistant")
TOOL_ROLES = ("tool", "function")


class ConversationError(RequestRejectedError):
    """A conversation of a batch refused; its message starts ``conversation <index>: ``,
    ``detail`` is the rest (what the server answers: a request holds one conversation)."""

    def __init__(self, message: str, index: int = 0, field: str = "prompt") -> None:
        super().__init__(message, index, field)
        prefix = f"conversation {index}: "
        self.detail = message[len(prefix):] if message.startswith(prefix) else message


class ChatTemplateError(ConversationError):
    """Chat asked of an engine without a tokenizer or a chat template, or a template that does
    not render these messages (the message says which). Nothing was queued."""


class ChatMessageError(ConversationError):
    """A message that is not a {"role", "content"} dict of a known role with text content
    (``field`` names the offending part, e.g. ``messages[1].role``). Nothing was queued."""

    def __init__(self, message: str, index: int = 0, field: str = "messages") -> None:
        super().__init__(message, index, field)


def check_messages(messages, index: int = 0) -> List[dict]:
    """The conversation as [{"role", "content": str}], or ChatMessageError naming what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatMessageError(f"conversation {index}: messages must be a non-empty list of "
                               f"{{'role', 'content'}} dicts, got {str(messages)[:60]!r}", index)
    return [_message(m, i, index) for i, m in enumerate(messages)]


def _message(message, i: int, index: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ChatMessageError(f"conversation {index}: {where} must be a dict with 'role' and "
                               f"'content', got {str(message)[:60]!r}", index, where)
    role = message.get("role")
    if role in TOOL_ROLES:
        raise ChatMessageError(f"conversation {index}: {where}.role {role!r} is not supported: "
                               f"tool calls are not supported (a message's role is "
                               f"{', '.join(ROLES)})", index, f"{where}.role")
    if not isinstance(role, str) or role not in ROLES:
        shown = repr(role[:60]) if isinstance(role, str) else repr(role)[:60]
        raise ChatMessageError(f"conversation {index}: {where}.role must be one of "
                               f"{', '.join(ROLES)}, got {shown}", index, f"{where}.role")
    other = sorted(set(message) - {"role", "content", "name"}, key=str)
    if other:      # tool calls, tool call ids, ...: not rendered, so refused, never dropped
        key = _shown_key(other[0])
        raise ChatMessageError(f"conversation {index}: {where}.{key} is not supported (a "
                               f"message takes role, content and name)", index, f"{where}.{key}")
    checked = {"role": "system" if role == "developer" else role, "content": _text(message.get("content"), f"{where}.content", index)}
    if "name" in message:
        if not isinstance(message["name"], str):
            raise ChatMessageError(f"conversation {index}: {where}.name must be a string, got "
                                   f"{str(message['name'])[:60]!r}", index, f"{where}.name")
        # the template's to render (or not), as vLLM's: Unicode text, as content must be
        checked["name"] = _unicode(message["name"], f"{where}.name", index)
    return checked


def _shown_key(key) -> str:
    """A message's key as an error names it: as sent when it is Unicode text, else escaped
    (a lone surrogate, "\\ud800" in JSON, could not be encoded into the server's answer: a 500
    instead of the 400)."""
    if isinstance(key, str) and is_unicode_text(key):
        return key
    return ascii(key)


def _text(content, where: str, index: int) -> str:
    if isinstance(content, list):
        content = "\n".join(_part_text(part, f"{where}[{j}]", index)
                            for j, part in enumerate(content))
    if isinstance(content, str):
        return _unicode(content, where, index)
    raise ChatMessageError(f"conversation {index}: {where} must be a string or a list of "
                           f"{{'type': 'text', 'text': ...}} parts (only text is supported), "
                           f"got {str(content)[:60]!r}", index, where)


def _unicode(text: str, where: str, index: int) -> str:
    """``text``, or ChatMessageError naming ``where`` when it holds a lone surrogate."""
    if not is_unicode_text(text):
        raise ChatMessageError(f"conversation {index}: {where} holds a lone surrogate "
                               f"(\\ud800-\\udfff without its pair): not Unicode text",
                               index, where)
    return text


def _part_text(part, where: str, index: int) -> str:
    """The text of one content part, or ChatMessageError naming ``where`` (the part), its
    ``.type`` (only "text" is supported), its ``.text`` or a key it may not have."""
    if not isinstance(part, dict):
        raise ChatMessageError(f"conversation {index}: {where} must be a {{'type': 'text', "
                               f"'text': ...}} part, got {str(part)[:60]!r}", index, where)
    kind = part.get("type")
    if kind != "text":
        shown = repr(kind[:60]) if isinstance(kind, str) else repr(kind)[:60]
        raise ChatMessageError(f"conversation {index}: {where}.type {shown} is not supported "
                               f"(only text is supported: {{'type': 'text', 'text': ...}})",
                               index, f"{where}.type")
    other = sorted(set(part) - {"type", "text"}, key=str)
    if other:      # cache_control, ...: not rendered, so refused, never dropped
        key = _shown_key(other[0])
        raise ChatMessageError(f"conversation {index}: {where}.{key} is not supported (a text "
                               f"part takes type and text)", index, f"{where}.{key}")
    if not isinstance(part.get("text"), str):
        raise ChatMessageError(f"conversation {index}: {where}.text must be a string, got "
                               f"{str(part.get('text'))[:60]!r}", index, f"{where}.text")
    return part["text"]


def with_system(messages: Sequence[dict], system: Optional[str]) -> List[dict]:
    """``messages`` with a system message first when ``system`` is given and the conversation
    has none (anywhere: one after the first turn is its own, and a second would be added)."""
    messages = list(messages)
    if system is not None and not any(isinstance(m, dict) and m.get("role") == "system"
                                      for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def chat_prompt_ids(tokenizer, messages, chat_template: Optional[str] = None,
                    add_generation_prompt: bool = True, index: int = 0,
                    check_text: Optional[Callable[[str], None]] = None) -> List[int]:
    """Token ids of one conversation, rendered by the template (``chat_template`` or the
    tokenizer's); ChatTemplateError / ChatMessageError when it cannot be. ``check_text`` (the
    server's length bound) sees the rendered text before it is tokenized; what it raises
    passes through."""
    checked = check_messages(messages, index)
    if tokenizer is None:
        raise ChatTemplateError(f"conversation {index}: chat needs a tokenizer with a chat "
                                f"template; this engine has no tokenizer (a built-in random-"
                                f"weight model): send token ids or text prompts", index)
    if chat_template is not None and not chat_template.strip():
        raise ChatTemplateError(f"conversation {index}: chat_template is empty; omit it to use "
                                f"the model's", index)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"conversation {index}: the model's tokenizer has no chat "
                                f"template; pass chat_template (a Jinja template) or send a "
                                f"text prompt", index)
    # None renders the tokenizer's own as transformers resolves it: a dict of named templates
    # (tokenizer_config's list of {name, template}) by its "default" (passed on, the dict was
    # a TypeError, "unhashable type", and such a model could not chat at all)
    if check_text is not None:    # rendered alone first: the text may be refused untokenized
        check_text(_rendered(tokenizer, checked, chat_template, add_generation_prompt, index,
                             False))
    ids = _rendered(tokenizer, checked, chat_template, add_generation_prompt, index, True)
    if not ids:
        raise ChatTemplateError(f"conversation {index}: the chat template rendered nothing", index)
    return list(ids)


def _rendered(tokenizer, checked: List[dict], template: Optional[str],
              add_generation_prompt: bool, index: int, tokenize: bool):
    """The conversation rendered by ``template`` (a Jinja template, the name of one of the
    tokenizer's, or None: its own): its token ids, or (``tokenize`` False) its text;
    ChatTemplateError when the template fails on it."""
    try:
        return tokenizer.apply_chat_template(checked, chat_template=template, tokenize=tokenize,
                                             return_dict=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as error:  # noqa: BLE001 -- a template (maybe the user's) failed on input
        raise ChatTemplateError(f"conversation {index}: the chat template does not render "
                                f"these messages: {type(error).__name__}: {error}", index) from None


def is_conversation(value) -> bool:
    """One conversation (a list of message dicts), as opposed to a list of conversations."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)


def chat_prompts(tokenizer, conversations, chat_template: Optional[str] = None,
                 add_generation_prompt: bool = True) -> List[List[int]]:
    """Token ids of one conversation or of each of a list of conversations."""
    batch = [conversations] if is_conversation(conversations) else conversations
    if not isinstance(batch, (list, tuple)) or not batch:
        raise ChatMessageError("messages must be a conversation (a list of {'role', 'content'} "
                               "dicts) or a non-empty list of them")
    return [chat_prompt_ids(tokenizer, c, chat_template, add_generation_prompt, i)
            for i, c in enumerate(batch)]
