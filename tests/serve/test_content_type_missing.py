"""A POST without a Content-Type header is a 415 that says the header is missing; before, it
said the client sent the type 'none' (``got 'none'``), which a client that sent no header
cannot find in its request, and which a client that did send ``Content-Type: none`` got too."""
from __future__ import annotations

from . import local_http
from .conftest import VMEM, serving

BODY = b'{"prompt": [1, 2, 3], "max_tokens": 2}'


def test_a_post_without_a_content_type_is_told_the_header_is_missing():
    with serving(VMEM) as (server, _):
        url = server.url + "/v1/completions"
        bare = local_http.post(url, content=BODY)
        assert bare.status_code == 415
        assert bare.json()["error"]["message"] == \
            "Content-Type must be application/json, got no Content-Type header"
        literal = local_http.post(url, content=BODY, headers={"Content-Type": "none"})
        assert literal.status_code == 415
        assert literal.json()["error"]["message"] == \
            "Content-Type must be application/json, got 'none'"
