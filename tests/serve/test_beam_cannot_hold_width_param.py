"""A beam search the engine fails alone because its cache can never hold the group (preempted,
each beam needs its own copy: RequestTooLargeError after it ran) is a 400 naming the field
that set its width as the client sent it: ``n`` where ``beam_width`` was left out (it
defaults to n), as every other refusal of the width does (docs/usage.md). Before, that 400
named ``beam_width``, a field the request never sent, and told the client to shrink it."""
from __future__ import annotations

import pytest

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer
from .conftest import assert_memory_at_baseline, serving, wait_until_idle

# a paged cache of 128 tokens: 8 beams of up to 64 tokens (a 20-token prompt, as the chat's is,
# and 44 more) pass the request check (the group's least held fits) and fail once they grow
# apart
SMALL_PAGED = dict(cache="paged", block_size=8, max_batch=8, max_context=64,
                   cache_bytes=64 * 1024)
SEARCH = dict(use_beam_search=True, max_tokens=44, ignore_eos=True)


@pytest.mark.parametrize("width, param", [(dict(n=8), "n"),
                                          (dict(n=2, beam_width=8), "beam_width")],
                         ids=["n-sets-the-width", "beam_width-sent"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_beam_group_the_cache_can_never_hold_names_the_width_field_the_client_sent(
        width, param, route):
    tokenizer = byte_tokenizer(chat_template=True) if route == "chat" else None
    with serving(SMALL_PAGED, tokenizer=tokenizer) as (server, engine):
        if route == "chat":
            body = {**SEARCH, **width, "messages": [{"role": "user", "content": "hi"}]}
            url = server.url + "/v1/chat/completions"
        else:
            body = {**SEARCH, **width, "prompt": list(range(1, 21))}
            url = server.url + "/v1/completions"
        r = local_http.post(url, json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert "cannot hold this request" in error["message"]
        assert error["message"].endswith(f"a smaller {param} fits")
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
