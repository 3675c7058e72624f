"""An engine step that raises something it cannot blame on one request (its one request fails
alone: "every request fails alone" is the engine's fault, by the engine's rule) ends only the
requests that step ran. The server aborted every live request: a request still waiting, never
computed, was failed with another client's error (a prompt whose logits are NaN, alone in its
step, failed the whole queue)."""
from __future__ import annotations

import threading
import time

import torch

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.models import build_model
from vmemkv.runtime.serve import Server

from . import local_http
from .conftest import NAME, VMEM, assert_memory_at_baseline, wait_until_idle

POISON_TOKEN = 5      # its embedding is NaN: a prompt holding it has NaN logits
GOOD = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
BAD = {"prompt": [1, POISON_TOKEN, 3], "max_tokens": 4, "temperature": 0}


def _poisoned_model():
    model = build_model(NAME, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON_TOKEN].fill_(float("nan"))
    return model


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s          # a bound on a deadlock, not a timing check
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def test_a_step_failing_unattributably_ends_its_own_requests_and_the_waiting_one_is_served(
        monkeypatch):
    with Engine(_poisoned_model(), None, **dict(VMEM, max_batch=1)) as engine, \
            Server(engine, NAME, host="127.0.0.1", port=0).start() as server:
        url, step, opened = server.url + "/v1/completions", engine.step, threading.Event()
        queued = lambda: len(engine.scheduler.waiting) + len(engine.scheduler.running)  # noqa: E731

        def gated():      # no step until both requests are queued: the bad one first
            if not opened.is_set() and queued() < 2:
                time.sleep(0.002)
                return []
            opened.set()
            return step()
        monkeypatch.setattr(engine, "step", gated)
        answers = {}

        def post(name, body):
            answers[name] = local_http.post(url, json=body, timeout=60)
        bad = threading.Thread(target=post, args=("bad", BAD))
        bad.start()
        _wait_for(lambda: queued() == 1)
        good = threading.Thread(target=post, args=("good", GOOD))
        good.start()
        bad.join(120)
        good.join(120)
        # max_batch 1: the bad request ran alone, failed alone, and was all its step ran
        assert answers["bad"].status_code == 500
        assert answers["good"].status_code == 200, answers["good"].text
        again = local_http.post(url, json=GOOD, timeout=60)      # the same request, alone
        assert again.status_code == 200
        assert answers["good"].json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
        assert answers["good"].json()["usage"]["completion_tokens"] == 4
        wait_until_idle(server)
        assert_memory_at_baseline(engine)
