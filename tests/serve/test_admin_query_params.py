"""vLLM's clients send /sleep's ``level`` and /wake_up's ``tags`` in the query string
(``POST /sleep?level=1``, ``POST /wake_up?tags=kv_cache``): they are read and checked as
strictly as a body, never ignored. Before, ``POST /sleep?level=2`` put the engine to sleep at
level 1 and answered 200 (the same level in the body is a 400), ``?tags=weights`` woke the
KV cache it asks to leave asleep, and a misspelt parameter did whatever the bare route does."""
from __future__ import annotations

import pytest

from .conftest import serving
from .test_elastic import CACHE, ELASTIC, error_of, is_sleeping, post


@pytest.mark.parametrize("path, param, words", [
    ("/sleep?level=2", "level", "only level 1"),
    ("/sleep?level=1&level=2", "level", "only level 1"),
    ("/sleep?levle=1", "levle", "unknown query parameter"),
    ("/resize?cache_bytes=8192", "cache_bytes", "unknown query parameter"),
], ids=["level-2", "level-twice", "misspelt", "resize-in-query"])
def test_a_bad_query_parameter_is_a_400_naming_it_and_changes_nothing(path, param, words):
    with serving(ELASTIC) as (server, engine):
        refused = post(server, path)
        assert refused.status_code == 400, refused.text
        error = error_of(refused)
        assert error["param"] == param and words in error["message"], error
        assert is_sleeping(server) is False and engine.cache_bytes == CACHE


def test_vllms_query_string_forms_sleep_and_wake_and_tags_that_leave_the_cache_asleep_are_400():
    with serving(ELASTIC) as (server, engine):
        asleep = post(server, "/sleep?level=1")
        assert asleep.status_code == 200 and asleep.json()["is_sleeping"] is True
        for tags in ("tags=weights", "tags=kv", "tags=kv_cache&tags=other"):
            refused = post(server, f"/wake_up?{tags}")
            assert refused.status_code == 400, refused.text
            assert error_of(refused)["param"] == "tags"
            assert is_sleeping(server) is True
        awake = post(server, "/wake_up?tags=weights&tags=kv_cache")
        assert awake.status_code == 200, awake.text
        assert awake.json() == {"is_sleeping": False, "cache_bytes": CACHE}
        assert is_sleeping(server) is False and engine.cache_bytes == CACHE
