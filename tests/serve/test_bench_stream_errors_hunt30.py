"""``vmemkv bench serve`` reads a streamed error whatever its shape: a server that sends the
error as a string (TGI's ``{"error": "...", "error_type": ...}``) was reported as
"AttributeError: 'str' object has no attribute 'get'", not its message."""
from vmemkv.runtime.serve.bench_client import StreamResult, _take_chunk


def test_a_string_error_chunk_is_the_requests_error_message():
    result = StreamResult()
    line = 'data: {"error": "Input validation error: max_new_tokens", "error_type": "validation"}'
    assert _take_chunk(line, result) is True
    assert result.error == "Input validation error: max_new_tokens" and not result.token_ids
    openai = StreamResult()     # OpenAI's error object still gives its message
    assert _take_chunk('data: {"error": {"message": "too long", "code": 400}}', openai) is True
    assert openai.error == "too long"
