"""GET /metrics: Prometheus text with vLLM's names under "vmemkv:", counters that count what
was served, histograms that are cumulative and count every finished request."""
from __future__ import annotations

import re


from vmemkv.runtime.serve.metrics import Histogram

from . import local_http
from .conftest import PAGED, prompts, serving, wait_until_idle

SAMPLE = re.compile(r'^(vmemkv:\w+)\{model_name="tiny-llama"'
                    r'(?:,le="([^"]+)"|(,finished_reason="\w+"))?\} (\S+)$')
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
              "time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "prompt_tokens_total", "generation_tokens_total",
              "request_success_total")


def parse(text: str) -> dict:
    """{name: value} ({'name{finished_reason="x"}': value} for request_success_total) and
    {histogram_bucket: [(le, count), ...]}; every line is a comment, a TYPE/HELP line or a
    sample."""
    values, buckets = {}, {}
    for line in text.splitlines():
        if line.startswith("# "):
            assert re.match(r"# (HELP|TYPE) vmemkv:\w+ ", line), line
            continue
        name, le, reason, value = SAMPLE.match(line).groups()
        if reason is not None:
            values[f"{name}{{{reason[1:]}}}"] = float(value)
        elif le is None:
            values[name] = float(value)
        else:
            buckets.setdefault(name, []).append((float(le), float(value)))
    return values, buckets


def test_metrics_count_what_was_served_with_vllm_names():
    batch = prompts(5, 3, 10, seed=2)
    with serving(dict(PAGED, prefix_sharing=True)) as (server, _):
        for p in batch:
            body = {"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            assert local_http.post(server.url + "/v1/completions", json=body).status_code == 200
        wait_until_idle(server)
        response = local_http.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    values, buckets = parse(response.text)
    for name in VLLM_NAMES:
        assert any(key.startswith(f"vmemkv:{name}") for key in list(values) + list(buckets)), name
    assert values['vmemkv:request_success_total{finished_reason="length"}'] == 5   # max_tokens
    assert values['vmemkv:request_success_total{finished_reason="stop"}'] == 0
    assert values["vmemkv:prompt_tokens_total"] == sum(map(len, batch))
    assert values["vmemkv:generation_tokens_total"] == 20
    assert values["vmemkv:prefix_cache_queries_total"] >= sum(map(len, batch))
    assert values["vmemkv:num_requests_running"] == values["vmemkv:num_requests_waiting"] == 0
    for name, per_request in (("time_to_first_token_seconds", 5), ("e2e_request_latency_seconds", 5),
                              ("time_per_output_token_seconds", 5)):
        counts = [n for _, n in buckets[f"vmemkv:{name}_bucket"]]
        assert counts == sorted(counts) and counts[-1] == per_request   # cumulative, +Inf last
        assert values[f"vmemkv:{name}_count"] == per_request and values[f"vmemkv:{name}_sum"] > 0


def test_histogram_buckets_are_cumulative_upper_bounds():
    h = Histogram("x_seconds", "x", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    lines = h.render('model_name="m"')
    assert lines[2:] == ['vmemkv:x_seconds_bucket{model_name="m",le="0.1"} 2',
                         'vmemkv:x_seconds_bucket{model_name="m",le="1.0"} 3',
                         'vmemkv:x_seconds_bucket{model_name="m",le="+Inf"} 4',
                         'vmemkv:x_seconds_sum{model_name="m"} 3.65',
                         'vmemkv:x_seconds_count{model_name="m"} 4']


def test_a_client_with_its_answer_reads_its_request_gone_from_the_gauges(monkeypatch):
    """The request ends inside an engine step; its client hears of it only after that step's
    gauges were refreshed. Here each refresh once no request is live is slowed by up to a
    second: before, the client had its answer while the gauges still counted the request."""
    import threading
    with serving(dict(PAGED)) as (server, _):
        thread, read = server.engine_thread, threading.Event()
        refresh = thread._refresh_gauges

        def slow_refresh() -> None:
            if not thread._live:
                read.wait(1.0)
            refresh()

        monkeypatch.setattr(thread, "_refresh_gauges", slow_refresh)
        body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        assert local_http.post(server.url + "/v1/completions", json=body).status_code == 200
        values, _ = parse(local_http.get(server.url + "/metrics").text)
        read.set()
        assert values["vmemkv:num_requests_running"] == 0
        assert values["vmemkv:num_requests_waiting"] == 0
        assert values["vmemkv:kv_cache_usage_perc"] == 0
