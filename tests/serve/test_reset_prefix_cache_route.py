"""``POST /reset_prefix_cache`` (vLLM's route): it evicts every cached prefix no request in
flight holds and answers how many tokens; the same prompt then hits nothing (a benchmark's cold
start) and gets the same tokens; a body field or query parameter it does not take is a 400
naming it, with nothing evicted; it is an operator route (a tenant's key is 403)."""
from __future__ import annotations

import pytest

from vmemkv.runtime.serve.auth import AuthConfig

from . import local_http
from .conftest import VMEM, PAGED, serving
from .test_elastic import complete, error_of, post, tokens_of

PROMPT = list(range(3, 43))        # 40 tokens: several prefix units


@pytest.mark.parametrize("options", [VMEM, PAGED], ids=["vmem", "paged"])
def test_a_reset_evicts_the_cached_prefix_and_the_next_request_hits_nothing(options):
    with serving(dict(options, prefix_sharing=True, prefix_eviction="lru")) as (server, engine):
        first = tokens_of(complete(server, PROMPT))
        cached = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        assert cached > 0
        answer = post(server, "/reset_prefix_cache")
        assert answer.status_code == 200 and answer.json() == {"evicted_tokens": cached}
        assert engine.scheduler.gauges()["prefix_cache_cached_tokens"] == 0
        hits = engine.scheduler.gauges()["prefix_cache_hits"]
        assert tokens_of(complete(server, PROMPT)) == first
        assert engine.scheduler.gauges()["prefix_cache_hits"] == hits     # a cold start
        assert post(server, "/reset_prefix_cache", {}).json()["evicted_tokens"] > 0
        engine.kv.manager.check_integrity()


@pytest.mark.parametrize("body, query, field", [({"device": "gpu"}, "", "device"),
                                                 (None, "?device=gpu", "device"),
                                                 ("[]", "", None)])
def test_a_field_it_does_not_take_is_a_400_and_evicts_nothing(body, query, field):
    with serving(dict(VMEM, prefix_sharing=True, prefix_eviction="lru")) as (server, engine):
        tokens_of(complete(server, PROMPT))
        cached = engine.scheduler.gauges()["prefix_cache_cached_tokens"]
        refused = post(server, "/reset_prefix_cache" + query, body)
        assert refused.status_code == 400, refused.text
        if field is not None:
            assert error_of(refused)["param"] == field
        assert engine.scheduler.gauges()["prefix_cache_cached_tokens"] == cached > 0


def test_it_is_an_operator_route():
    keys = AuthConfig(("tenant-a",), salt_per_key=True, admin_key="operator-z")
    with serving(VMEM, auth=keys) as (server, engine):
        def call(key):
            return local_http.post(server.url + "/reset_prefix_cache", json={}, timeout=30,
                                   headers={"Authorization": f"Bearer {key}"})
        assert call("tenant-a").status_code == 401
        answer = call("operator-z")
        assert answer.status_code == 200 and answer.json() == {"evicted_tokens": 0}
