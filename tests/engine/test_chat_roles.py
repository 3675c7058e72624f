"""OpenAI's ``developer`` role (its newer name for ``system``) reaches the chat template as
``system`` on the engine's own chat (``Engine.chat``, ``vmemkv generate --chat``), not only on
the server; ``tool`` / ``function`` messages are refused naming the role (tool calls are not
supported). Both were "messages[0].role must be one of system, user, assistant"."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine.chat import ChatMessageError, check_messages


def test_a_developer_message_is_checked_as_a_system_message():
    checked = check_messages([{"role": "developer", "content": "be kind"},
                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert checked == [{"role": "system", "content": "be kind"},
                       {"role": "user", "content": "hi"}]
    assert checked == check_messages([{"role": "system", "content": "be kind"},
                                      {"role": "user", "content": "hi"}])


@pytest.mark.parametrize("role, message", [
    ("tool", "messages[1].role 'tool' is not supported: tool calls are not supported (a "
             "message's role is system, developer, user, assistant)"),
    ("function", "messages[1].role 'function' is not supported: tool calls are not supported "
                 "(a message's role is system, developer, user, assistant)"),
    ("robot", "messages[1].role must be one of system, developer, user, assistant, got 'robot'"),
    ("x" * 100, "messages[1].role must be one of system, developer, user, assistant, got "
                f"'{'x' * 60}'"),
], ids=["tool", "function", "unknown", "long-unknown"])
def test_tool_and_unknown_roles_are_refused_naming_the_role(role, message):
    with pytest.raises(ChatMessageError) as refused:
        check_messages([{"role": "user", "content": "hi"}, {"role": role, "content": "4"}], 3)
    assert str(refused.value) == f"conversation 3: {message}"
    assert (refused.value.field, refused.value.index) == ("messages[1].role", 3)
