"""A submission answers what its choices got when every choice of a prompt has its finish reason
before the request's end arrives, whatever that end says (runtime/serve/submission.py
``Submission._end``: an end cuts a request short only while a choice is unfinished). Driven
through the app in process with a fake engine thread, as tests/serve/test_app_submission.py."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from vmemkv.runtime.engine.outputs import TokenEvent
from vmemkv.runtime.serve.engine_thread import Ended, Token

from .test_app_submission import TOP, TwoTokenEngineThread, post

BODY = {"prompt": "hi", "max_tokens": 2}


class EndsAfterTokens(TwoTokenEngineThread):
    """Sends the first ``sent`` of the two tokens (the second finishes the choice), then
    ``end``."""

    def __init__(self, end: Ended, sent: int = 2) -> None:
        super().__init__()
        self.end, self.sent = end, sent

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        self.submitted.append((list(ids), params))
        request_id = len(self.submitted)
        events = [TokenEvent(request_id, 0, 65, False, text="A", logprobs=TOP),
                  TokenEvent(request_id, 0, 66, True, "length", "B", logprobs=TOP)]
        for event in events[:self.sent]:
            sink(Token(event, 0.0))
        sink(self.end)
        future: Future = Future()
        future.set_result(request_id)
        return future


@pytest.mark.parametrize("end", [Ended("aborted"), Ended("failed", "boom", alone=True),
                                 Ended("failed", "engine closed")])
def test_an_end_after_every_choice_finished_answers_the_choices_not_an_error(end, monkeypatch):
    got, made = post("/v1/completions", BODY, monkeypatch, EndsAfterTokens(end))
    assert got.status_code == 200, got.text
    (choice,) = got.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("AB", "length")
    assert made[0].choices[0].token_ids == [65, 66]


def test_the_same_end_before_the_choice_finished_is_an_error(monkeypatch):
    got, _ = post("/v1/completions", BODY, monkeypatch,
                  EndsAfterTokens(Ended("failed", "boom", alone=True), sent=1))
    assert got.status_code == 500 and got.json()["error"]["type"]
