"""OpenAI chat fields this server takes only at their no-op values.

    response_format  {"type": "text"} (OpenAI's default) or null; json_object / json_schema
                     (structured output) are a 400 naming ``response_format.type``
    tools            [] or null; any tool is a 400 naming ``tools``
    tool_choice      "none" or null; "auto", "required" or a named tool: a 400 naming it

(Roles are the engine's: ``developer`` is rendered as ``system``, ``tool`` / ``function``
messages refused naming ``messages[i].role``: runtime/engine/chat.py.)
"""
from __future__ import annotations

from typing import Optional

from vmemkv.runtime.engine.prompts import is_unicode_text

from .errors import ApiError


def check_no_ops(response_format: Optional[dict], tools: Optional[list], tool_choice) -> None:
    """ApiError 400 naming the field unless each is its no-op value (or null)."""
    check_response_format(response_format)
    if tools:
        raise ApiError(400, f"tools: tool calls are not supported (this server runs no tools), "
                            f"got {len(tools)} tool(s); send [] or omit tools", "tools")
    if tool_choice is not None and tool_choice != "none":
        raise ApiError(400, f"tool_choice {repr(tool_choice)[:60]} is not supported: tool calls "
                            f"are not supported; send \"none\" or omit tool_choice", "tool_choice")


def check_response_format(value: Optional[dict]) -> None:
    """ApiError 400 naming the part of ``response_format`` that is not ``{"type": "text"}``."""
    if value is None:
        return
    if "type" not in value:
        raise ApiError(400, "response_format.type: Field required (only {\"type\": \"text\"} is "
                            "supported)", "response_format.type")
    kind = value["type"]
    if kind != "text":
        shown = repr(kind[:60]) if isinstance(kind, str) else repr(kind)[:60]
        raise ApiError(400, f"response_format.type {shown} is not supported: structured output "
                            f"is not implemented; only {{\"type\": \"text\"}} is",
                       "response_format.type")
    other = sorted((str(k) for k in value if k != "type"))
    if other:
        key = other[0][:40] if is_unicode_text(other[0]) else ascii(other[0])[:40]
        raise ApiError(400, f"response_format.{key} is not supported (a text response_format "
                            f"takes only type)", f"response_format.{key}")
