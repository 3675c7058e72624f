"""Three small server gaps (found 2026-12-07), fixed:

* ``include_stop_str_in_output: true`` with ``use_beam_search`` was taken (200) and did nothing
  (``stop`` is refused with beam search): it is a 400 naming it, as the other fields beam search
  does not honour are; ``false``, the default, is taken.
* With ``beam_width`` left out (its default is ``n``), the engine thread's refusal of the width
  (above --max-batch, more candidates than the vocabulary) answered ``param: "beam_width"``, a
  field the client never sent: it names ``n``.
* A streamed response's bound counted its tokens but not each token's SSE chunk envelope
  (``data: {"id":...,"object":...,"created":...,"model":...,"choices":[...]}``): with long
  tokens a stream passed the --max-response-bytes that admitted it. Each token now counts its
  chunk and the spaces after its JSON's separators (``response_bounds.stream_bound``), and a
  chunk's strings are UTF-8 as a JSON response's are (they were ASCII escapes: "é" took 6
  bytes, not the 2 the bound measures).
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from vmemkv.runtime.engine.errors import BeamSearchParamsError
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.chat import parse_chat_request
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.metrics import ServeMetrics
from vmemkv.runtime.serve.protocol import parse_completion_request

from .test_chat_beam_window import RefusingEngineThread
from .test_tenant_hunt_fixes import (LONG_IDS, LongTokenEngineThread, MESSAGES, PROMPT,
                                     long_token_tokenizer)

APIS = {"completions": (parse_completion_request, {"prompt": [1, 2, 3], "max_tokens": 2},
                        lambda req: req.sampling_params()),
        "chat": (parse_chat_request, {"messages": MESSAGES},
                 lambda req: req.sampling_params(2))}
BEAMS = {"use_beam_search": True, "n": 2, "ignore_eos": True}


@pytest.mark.parametrize("api", list(APIS))
def test_include_stop_str_in_output_true_with_beam_search_is_400_naming_it(api):
    parse, base, params = APIS[api]
    with pytest.raises(ApiError) as refused:
        params(parse(json.dumps({**base, **BEAMS, "include_stop_str_in_output": True}).encode()))
    assert (refused.value.status, refused.value.param) == (400, "include_stop_str_in_output")
    assert refused.value.message.startswith("include_stop_str_in_output is not supported with "
                                            "use_beam_search")
    taken = params(parse(json.dumps({**base, **BEAMS,
                                     "include_stop_str_in_output": False}).encode()))
    assert (taken.beam_width, taken.returned_beams) == (2, 2)     # false does nothing: taken


def _post(engine_thread, path: str, body: dict) -> httpx.Response:
    tokenizer = long_token_tokenizer()
    app = create_app(engine_thread, ServeMetrics("m"),
                     ServedModel("m", tokenizer, len(tokenizer), 4096, 8))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=10)
    return asyncio.run(run())


@pytest.mark.parametrize("width, param", [({}, "n"), ({"beam_width": 2}, "beam_width")])
@pytest.mark.parametrize("path, base", [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})], ids=["cmpl", "chat"])
def test_an_engine_refusal_of_a_defaulted_beam_width_names_n(path, base, width, param):
    error = BeamSearchParamsError("BeamSearchParams.beam_width 2 needs 402 candidates a step, "
                                  "more than the vocabulary's 256 tokens", "beam_width")
    got = _post(RefusingEngineThread(error), path, {**base, **BEAMS, **width})
    assert got.status_code == 400
    assert got.json()["error"] == {
        "message": f"{param} 2 needs 402 candidates a step, more than the vocabulary's 256 "
                   f"tokens", "type": "invalid_request_error", "param": param, "code": None}


STREAMS = {
    "cmpl-echo-logprobs": ("/v1/completions", {"prompt": [PROMPT, PROMPT[:5]], "max_tokens": 30,
                                               "n": 2, "echo": True, "logprobs": 5}),
    "cmpl-plain": ("/v1/completions", {"prompt": PROMPT[:3], "max_tokens": 60}),
    "chat-top5": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40,
                                           "logprobs": True, "top_logprobs": 5, "n": 3}),
    "chat-plain": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60,
                                            "stream_options": {"include_usage": True}}),
}


@pytest.mark.parametrize("name", list(STREAMS))
def test_a_stream_never_passes_the_limit_that_admitted_it(name):
    path, body = STREAMS[name]
    body = {**body, "stream": True}
    refused = _post(LongTokenEngineThread(1), path, body)      # the estimate, from the 400
    assert refused.status_code == 400, refused.text[:300]
    estimate_bytes = int(re.search(r"could reach about ([\d,]+) bytes",
                                   refused.json()["error"]["message"])[1].replace(",", ""))
    answered = _post(LongTokenEngineThread(estimate_bytes), path, body)
    assert answered.status_code == 200, answered.text[:300]
    chunks = [json.loads(line[len("data: "):]) for line in answered.text.split("\n\n")
              if line.startswith("data: {")]
    tokens = sum(len(c["token_ids"]) for chunk in chunks for c in chunk["choices"]
                 if "token_ids" in c)
    prompt = body.get("prompt", [0])
    prompts = len(prompt) if isinstance(prompt[0], list) else 1
    assert tokens == prompts * body.get("n", 1) * body["max_tokens"]    # one chunk a token
    assert answered.text.endswith("data: [DONE]\n\n")
    assert set(LONG_IDS) <= {t for chunk in chunks for c in chunk["choices"]
                             for t in c.get("token_ids", [])}       # every long token streamed
    assert len(answered.content) <= estimate_bytes, (len(answered.content), estimate_bytes)
    one_less = _post(LongTokenEngineThread(estimate_bytes - 1), path, body)
    assert one_less.status_code == 400, one_less.text[:300]


def test_a_streamed_chat_logprobs_entry_of_the_longest_token_fits_its_bound(monkeypatch):
    """A stream's JSON has a space after every "," and ":": a chat logprobs entry of the
    tokenizer's longest token, its ``bytes`` list one space a byte, with the longest logprob,
    fits the stream bound's ``entry_bytes`` (and the compact one the JSON response's). The
    token: 60 "é", each of its 120 bytes three digits in ``bytes``, its JSON string as long."""
    from vmemkv.runtime.engine.logprobs import TokenLogprobs
    from vmemkv.runtime.serve.limits import ResponseBounds
    from vmemkv.runtime.serve.logprobs_format import TokenStrings, chat_logprobs
    from vmemkv.runtime.serve.response_bounds import stream_bound

    from . import test_tenant_hunt_fixes

    monkeypatch.setattr(test_tenant_hunt_fixes, "LONG_TEXTS", ["é" * 60])
    tokenizer = long_token_tokenizer.__wrapped__()        # not the cached one: this vocabulary
    bound = ResponseBounds.of(tokenizer, len(tokenizer)).chat
    strings = TokenStrings(tokenizer)
    assert len(strings.token_bytes(256)) == 120
    logprob = -1.2345678901234567e-308          # the longest float repr
    (entry,) = chat_logprobs(strings, [TokenLogprobs(256, logprob, 1)])["content"]
    top = {k: v for k, v in entry.items() if k != "top_logprobs"}     # as a top-k entry
    assert len(json.dumps(top, ensure_ascii=False, separators=(",", ":")).encode()) \
        <= bound.entry_bytes
    assert len(json.dumps(top, ensure_ascii=False).encode()) \
        <= stream_bound(bound, True, "m").entry_bytes
