"""OpenAI content parts in a chat message: text parts joined with "\\n" (as vLLM and
TensorRT-LLM join them; they were joined with "", "Line one.Line two."), in the engine's chat
so ``vmemkv generate --chat`` and the server agree; anything else in a part (an ``image_url``
part, a text part's ``cache_control``) refused naming ``messages[i].content[j]...``, never
dropped."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine.chat import ChatMessageError, chat_prompt_ids

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import VMEM, assert_memory_at_baseline, serving

TEXT = {"type": "text", "text": "Line two."}


def user(content) -> list:
    return [{"role": "user", "content": content}]


def test_text_parts_are_joined_with_a_newline():
    tok = byte_tokenizer(chat_template=True)
    parts = chat_prompt_ids(tok, user([{"type": "text", "text": "Line one."}, TEXT]))
    assert tok.decode(parts) == "<user>Line one.\nLine two.\n<assistant>"
    assert parts == chat_prompt_ids(tok, user("Line one.\nLine two."))
    assert chat_prompt_ids(tok, user([TEXT])) == chat_prompt_ids(tok, user("Line two."))


@pytest.mark.parametrize("content,field,words", [
    ([{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
     "messages[0].content[0].cache_control", "not supported"),
    ([TEXT, {"type": "image_url", "image_url": {"url": "http://a/b.png"}}],
     "messages[0].content[1].type", "'image_url' is not supported"),
    ([TEXT, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     "messages[0].content[1].type", "'input_audio' is not supported"),
    ([{"text": "no type"}], "messages[0].content[0].type", "None is not supported"),
    ([{"type": "text", "text": 3}], "messages[0].content[0].text", "must be a string"),
    ([TEXT, "bare"], "messages[0].content[1]", "part, got 'bare'"),
    ([{"type": "text", "text": "x", "\ud800": 1}], "messages[0].content[0].'\\ud800'",
     "not supported"),
])
def test_a_part_that_is_not_plain_text_is_refused_naming_it(content, field, words):
    with pytest.raises(ChatMessageError) as refused:
        chat_prompt_ids(byte_tokenizer(chat_template=True), user(content))
    assert refused.value.field == field and words in str(refused.value), str(refused.value)


def test_the_server_answers_a_400_naming_the_part():
    with serving(VMEM, tokenizer=byte_tokenizer(chat_template=True)) as (server, engine):
        response = local_http.post(server.url + "/v1/chat/completions", json={
            "messages": user([TEXT, {"type": "image_url", "image_url": {"url": "u"}}])})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages[0].content[1].type", error
        assert "'image_url'" in error["message"], error
        response = local_http.post(server.url + "/v1/chat/completions", json={
            "messages": user([{"type": "text", "text": "a"}, TEXT]), "max_completion_tokens": 1})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len("<user>a\nLine two.\n<assistant>")
        assert server.engine_thread.pending_requests == 0
        assert_memory_at_baseline(engine)
