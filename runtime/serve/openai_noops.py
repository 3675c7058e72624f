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

from pydantic import BaseModel, ConfigDict, model_validator

from vmemkv.runtime.engine.prompts import is_unicode_text

from .errors import ApiError


class NoOpFields(BaseModel):
    """The chat request's OpenAI fields that are taken only when they change nothing."""
    model_config = ConfigDict(extra="forbid", strict=True)
    response_format: Optional[dict] = None   # {"type": "text"}: plain text, the default
    tools: Optional[list] = None             # [] only: no tools
    tool_choice: object = None               # "none" only (any other value: 400 naming it)

    @model_validator(mode="after")
    def _only_no_ops(self):
        check_response_format(self.response_format)
        if self.tools:
            raise ApiError(400, f"tools: tool calls are not supported (this server runs no "
                                f"tools), got {len(self.tools)} tool(s); send [] or omit tools",
                           "tools")
        if self.tool_choice is not None and self.tool_choice != "none":
            shown = repr(self.tool_choice)[:60]
            raise ApiError(400, f"tool_choice {shown} is not supported: tool calls are not "
                                f"supported; send \"none\" or omit tool_choice", "tool_choice")
        return self


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
