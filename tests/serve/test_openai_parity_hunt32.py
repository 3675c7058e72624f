"""Hunt 32, the OpenAI server: fields and roles OpenAI's clients send that vLLM's server takes
(``developer`` messages, ``response_format`` text, no tools) and what stays refused by name."""
from __future__ import annotations

import contextlib
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from vmemkv.runtime.engine import Engine  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402
from vmemkv.runtime.serve import Server  # noqa: E402

from ..engine.byte_tokenizer import byte_tokenizer  # noqa: E402

VMEM = dict(cache="vmem", page_bytes=4096, max_batch=8, max_context=64)
NAME = "tiny-llama"
HI = [{"role": "user", "content": "hi"}]


@contextlib.contextmanager
def serving(**server_options):
    with Engine(build_model(NAME, seed=0), byte_tokenizer(chat_template=True), **VMEM) as engine:
        with Server(engine, NAME, host="127.0.0.1", port=0, **server_options).start() as server:
            yield server


@pytest.fixture(scope="module")
def server():
    with serving() as server:
        yield server


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", headers={"Content-Type":
                      "application/json"}, content=json.dumps({"max_tokens": 3, **body}))


def test_a_developer_message_is_rendered_as_a_system_message(server):
    """OpenAI's newer name for "system" was a 400 (messages[0].role must be one of ...)."""
    base = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    dev = chat(server, {**base, "messages": [{"role": "developer", "content": "be kind"}, *HI]})
    system = chat(server, {**base, "messages": [{"role": "system", "content": "be kind"}, *HI]})
    assert dev.status_code == 200, dev.text
    # the same rendered prompt: <system>be kind\n<user>hi\n<assistant> is 36 byte tokens
    assert dev.json()["usage"]["prompt_tokens"] == system.json()["usage"]["prompt_tokens"] == 36
    assert dev.json()["choices"][0]["token_ids"] == system.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "text"}}, {"response_format": None}, {"tools": []},
    {"tools": None}, {"tool_choice": "none"}, {"tool_choice": None},
    {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
], ids=["format-text", "format-null", "tools-empty", "tools-null", "choice-none", "choice-null",
        "all-three"])
def test_openai_default_values_of_unsupported_fields_are_taken(server, body):
    """OpenAI's defaults (what its SDK sends for "text, no tools") were unknown-field 400s."""
    response = chat(server, {"messages": HI, **body})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_object"}}, "response_format.type",
     "response_format.type 'json_object' is not supported: structured output is not "
     "implemented; only {\"type\": \"text\"} is"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.type", "response_format.type 'json_schema' is not supported: structured "
     "output is not implemented; only {\"type\": \"text\"} is"),
    ({"response_format": {}}, "response_format.type",
     "response_format.type: Field required (only {\"type\": \"text\"} is supported)"),
    ({"response_format": {"type": "text", "strict": True}}, "response_format.strict",
     "response_format.strict is not supported (a text response_format takes only type)"),
    ({"response_format": {"type": "text", "\ud800": 1}}, "response_format.'\\ud800'",
     "response_format.'\\ud800' is not supported (a text response_format takes only type)"),
    ({"response_format": "text"}, "response_format",
     "response_format: Input should be a valid dictionary, got \"text\""),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tools: tool calls are not supported (this server runs no tools), got 1 tool(s); send [] "
     "or omit tools"),
    ({"tool_choice": "auto"}, "tool_choice",
     "tool_choice 'auto' is not supported: tool calls are not supported; send \"none\" or omit "
     "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "tool_choice {'type': 'function', 'function': {'name': 'f'}} is not supported: tool calls "
     "are not supported; send \"none\" or omit tool_choice"),
    ({"messages": [*HI, {"role": "tool", "content": "4", "tool_call_id": "c1"}]},
     "messages[1].role", "messages[1].role 'tool' is not supported: tool calls are not "
     "supported (a message's role is system, developer, user, assistant)"),
    ({"messages": [{"role": "function", "content": "4", "name": "f"}, *HI]},
     "messages[0].role", "messages[0].role 'function' is not supported: tool calls are not "
     "supported (a message's role is system, developer, user, assistant)"),
    ({"messages": [*HI, {"role": "robot", "content": "x"}]}, "messages[1].role",
     "messages[1].role must be one of system, developer, user, assistant, got 'robot'"),
    ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant, got None"),
], ids=["json-object", "json-schema", "no-type", "text-extra-key", "surrogate-key",
        "not-object", "a-tool",
        "choice-auto", "choice-named", "tool-message", "function-message", "unknown-role",
        "null-role"])
def test_what_needs_tools_or_structured_output_is_refused_naming_the_field(server, body, param,
                                                                            message):
    response = chat(server, {"messages": HI, **body})
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": param, "code": None}}
    assert server.engine_thread.pending_requests == 0


def test_an_integer_past_pythons_digit_limit_is_a_400_that_gives_no_python_advice(server):
    """It was "not valid JSON: Exceeds the limit (4300 digits) for integer string conversion
    ...; use sys.set_int_max_str_digits() to increase the limit": valid JSON, and advice for
    the server's code, not the client."""
    body = b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    response = httpx.post(server.url + "/v1/completions", content=body,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "the request body holds an integer of more than 4300 digits (no field "
                   "takes one)", "type": "invalid_request_error", "param": None, "code": None}
    truncated = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi"',
                           headers={"Content-Type": "application/json"})
    assert truncated.json()["error"]["message"].startswith("the request body is not valid JSON: ")


@pytest.mark.parametrize("flag", ["--admin-key", "--metrics-key"])
def test_an_operator_key_that_is_also_a_tenants_api_key_is_refused_at_start(flag, capsys,
                                                                          monkeypatch):
    """With --salt-per-key each API key is a tenant's; an admin (or metrics) key equal to one
    was taken, and that tenant could reset the prefix cache, sleep the engine and read every
    tenant's figures."""
    from vmemkv.cli import main
    monkeypatch.setattr(Server, "run", lambda self: "served")   # a regression returns
    assert main(["serve", "--port", "0", "--max-context", "64", "--salt-per-key",
                 "--api-key", "tenant-a", "--api-key", "op-key", flag, "op-key"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} is also an API key: with --salt-per-key each API key is a tenant's, and " \
           f"{flag} opens what no tenant may" in err
    assert "op-key" not in err                          # a key is never shown
