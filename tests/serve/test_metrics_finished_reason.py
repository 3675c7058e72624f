"""``request_success_total`` is labelled by vLLM's ``finished_reason`` ("stop", "length"), as
``vllm:request_success_total`` is: it was one unlabelled count, so a dashboard that splits
answers cut at max_tokens from the ones that stopped found no series to split."""
from __future__ import annotations


from vmemkv.runtime.serve.metrics import ServeMetrics

from . import local_http
from .conftest import PAGED, VOCAB, serving, wait_until_idle

STOP = 'vmemkv:request_success_total{model_name="%s",finished_reason="stop"} %r'
LENGTH = 'vmemkv:request_success_total{model_name="%s",finished_reason="length"} %r'


def success_lines(text: str) -> list:
    return [line for line in text.splitlines() if "request_success_total" in line]


def test_each_finished_request_counts_once_under_its_finished_reason():
    metrics = ServeMetrics("m")
    assert success_lines(metrics.render())[2:] == [STOP % ("m", 0.0), LENGTH % ("m", 0.0)]
    metrics.observe_request(0.0, {0: [0.1]}, 3, "finished", ["stop"])
    metrics.observe_request(0.0, {0: [0.1, 0.2]}, 3, "finished", ["length"])
    # n 2: one sample stopped, one was cut at max_tokens: the answer was cut, counted once
    metrics.observe_request(0.0, {0: [0.1], 1: [0.1, 0.2]}, 3, "finished", ["stop", "length"])
    metrics.observe_request(0.0, {0: [0.1]}, 3, "aborted", [])     # its own counter
    metrics.observe_request(0.0, {}, 3, "failed", [])               # its own counter
    text = metrics.render()
    assert success_lines(text) == [
        "# HELP vmemkv:request_success_total Requests that finished, by finished_reason: stop "
        "(a stop token or string ended every sample) or length (a sample reached max_tokens).",
        "# TYPE vmemkv:request_success_total counter",
        STOP % ("m", 1.0), LENGTH % ("m", 2.0)]
    assert 'vmemkv:num_aborted_requests_total{model_name="m"} 1.0' in text.splitlines()
    assert 'vmemkv:num_failed_requests_total{model_name="m"} 1.0' in text.splitlines()


def test_the_server_counts_a_stopped_and_a_cut_request_under_their_reasons():
    with serving(dict(PAGED)) as (server, _):
        url = server.url + "/v1/completions"
        stopped = local_http.post(url, json={"prompt": [1, 2, 3], "max_tokens": 8, "n": 2,
                                        "stop_token_ids": list(range(VOCAB))}, timeout=60)
        cut = local_http.post(url, json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
                              timeout=60)
        assert [c["finish_reason"] for c in stopped.json()["choices"]] == ["stop", "stop"]
        assert [c["finish_reason"] for c in cut.json()["choices"]] == ["length"]
        wait_until_idle(server)
        lines = success_lines(local_http.get(server.url + "/metrics", timeout=30).text)
    assert lines[2:] == [STOP % ("tiny-llama", 1.0), LENGTH % ("tiny-llama", 1.0)]
