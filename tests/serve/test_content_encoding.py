"""A compressed body is refused as such: a 415 naming the Content-Encoding, before the body is
read. It was read as JSON and answered 400 "not valid JSON: 'utf-8' codec can't decode ...",
which sends a client looking for a JSON mistake it did not make."""
from __future__ import annotations

import gzip

import pytest

from . import local_http
from .conftest import VMEM, serving

BODY = b'{"prompt": [1, 2, 3], "max_tokens": 2}'
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with serving(VMEM) as (running, _):
        yield running


@pytest.mark.parametrize("coding, body", [("gzip", gzip.compress(BODY, mtime=0)), ("br", BODY),
                                          ("GZIP", gzip.compress(BODY, mtime=0))],
                         ids=["gzip", "br", "upper-case"])   # fixed ids: xdist workers agree
def test_a_compressed_body_is_415_naming_its_encoding(server, coding, body):
    answer = local_http.post(server.url + "/v1/completions", content=body,
                             headers={**JSON, "Content-Encoding": coding})
    assert answer.status_code == 415, answer.text
    assert answer.json()["error"]["message"] == (
        f"Content-Encoding {coding.strip().lower()!r} is not supported: send the JSON body "
        f"uncompressed")


def test_identity_is_the_body_as_sent(server):
    for headers in (JSON, {**JSON, "Content-Encoding": "identity"}):
        answer = local_http.post(server.url + "/v1/completions", content=BODY, headers=headers)
        assert answer.status_code == 200, answer.text
