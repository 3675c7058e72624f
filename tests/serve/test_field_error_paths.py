"""A 400 for a value inside a field says where in the field it is, as the client wrote the
request: the nested field (``stream_options.include_usage``), the list index (``prompt[1][0]``,
``stop[1]``); a union field's message is the form the value came closest to, or the forms it
may take. They named only the top field, with the rule of a union's first form (``prompt:
Input should be a valid string`` for a list of token-id lists), and an unknown nested key
listed the top-level fields as what ``stream_options`` takes. ``param`` stays the top field."""
from __future__ import annotations

import json

import pytest

from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.protocol import CompletionRequest, parse_request

CASES = [
    ({"prompt": [1], "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options", 'stream_options.include_usage: Input should be a valid boolean, got "yes"'),
    ({"prompt": [1], "stream": True, "stream_options": {"foo": 1}}, "stream_options",
     "unknown field 'stream_options.foo'; the fields stream_options takes: include_usage"),
    ({"prompt": [[1], ["a"]]}, "prompt",
     'prompt[1][0]: Input should be a valid integer, got "a"'),
    ({"prompt": [1, "a"]}, "prompt", 'prompt[1]: Input should be a valid integer, got "a"'),
    ({"prompt": 5}, "prompt",
     "prompt: should be one of str, list[int], list[str], list[list[int]], got 5"),
    ({"prompt": [1], "stop": ["a", 3]}, "stop", "stop[1]: Input should be a valid string, got 3"),
    ({"prompt": [1], "stop": 5}, "stop", "stop: should be one of str, list[str], got 5"),
    ({"prompt": [1], "logit_bias": {"5": "x"}}, "logit_bias",
     'logit_bias.5: Input should be a valid number, got "x"'),
]


@pytest.mark.parametrize("body, param, message", CASES, ids=[c[2][:24] for c in CASES])
def test_a_value_inside_a_field_is_named_where_it_is(body, param, message):
    with pytest.raises(ApiError) as refused:
        parse_request(json.dumps(body).encode(), CompletionRequest)
    assert (refused.value.status, refused.value.param, str(refused.value)) == (400, param, message)


def test_an_unknown_top_level_field_still_lists_the_servers_fields():
    with pytest.raises(ApiError) as refused:
        parse_request(b'{"prompt": [1], "frob": 1}', CompletionRequest)
    assert refused.value.param == "frob"
    assert str(refused.value).startswith("unknown field 'frob'; the fields this server takes: "
                                         "model, temperature,")
