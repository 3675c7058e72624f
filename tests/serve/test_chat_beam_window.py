"""Chat beam search on a windowed model is held to the beam-search limit, as completions are:
chat_token_ids checked a beam request against the per-prompt window limit (tiny-mistral-swa,
48 KiB: 256 tokens after a short prompt, 96 for a beam search), so a request that omitted
max_tokens defaulted to 236 new tokens and the engine refused it, naming its own field
'max_new_tokens' (chat_beam_window.py). Now the default is what the context leaves a beam
search, a max_tokens past it is refused up front naming max_tokens, and an engine refusal of
max_new_tokens names the client's field."""
from __future__ import annotations

import asyncio
from concurrent.futures import Future

import httpx
import pytest

from vmemkv.runtime.engine.errors import BeamSearchParamsError, RequestRejectedError
from vmemkv.runtime.serve.app import create_app
from vmemkv.runtime.serve.chat import chat_token_ids, parse_chat_request
from vmemkv.runtime.serve.completions import ServedModel
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.limits import DEFAULT_MAX_RESPONSE_BYTES
from vmemkv.runtime.serve.metrics import ServeMetrics

from ..engine.byte_tokenizer import byte_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]      # 20 tokens rendered ("<user>hi\n<assistant>")
BEAM = {"use_beam_search": True, "n": 2, "beam_width": 2, "ignore_eos": True}


def windowed() -> ServedModel:
    """chat_beam_window.py's limits: 256 tokens after any short prompt, 96 for a beam search."""
    return ServedModel("swa", byte_tokenizer(chat_template=True), 256, 97, 2,
                       fit=lambda prompt_tokens, adapter=None: 256,
                       beam_fit=lambda prompt_tokens, beams: 96)


def ids_and_max_tokens(body: dict):
    return chat_token_ids(parse_chat_request(httpx.Request("POST", "/", json=body).content),
                          windowed())


def test_a_chat_beam_search_without_max_tokens_gets_what_the_context_leaves_a_beam_search():
    ids, max_tokens = ids_and_max_tokens({"messages": MESSAGES, **BEAM})
    assert len(ids) == 20 and max_tokens == 96 - 20          # was 256 - 20 = 236
    ids, max_tokens = ids_and_max_tokens({"messages": MESSAGES})     # sampling: the window's
    assert max_tokens == 256 - 20


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_beam_search_past_its_limit_is_400_naming_the_clients_field(field):
    with pytest.raises(ApiError) as refused:
        ids_and_max_tokens({"messages": MESSAGES, field: 200, **BEAM})
    assert refused.value.status == 400 and refused.value.param == field
    assert refused.value.message == (f"this model's context is 96 tokens for a beam search of "
                                      f"beam_width 2 after a 20-token prompt; the request asks "
                                      f"for 220 (20 in the prompt, 200 {field})")
    assert ids_and_max_tokens({"messages": MESSAGES, field: 76, **BEAM})[1] == 76   # fits


class RefusingEngineThread:
    """The engine refuses every request as ``error``."""
    alive = True

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.max_response_bytes, self.response_budget = DEFAULT_MAX_RESPONSE_BYTES, None

    def submit(self, ids, params, sink, arrival_s, index=0, key=None) -> Future:
        future: Future = Future()
        future.set_exception(self.error)
        return future

    def abort(self, request_id) -> None:
        pass


@pytest.mark.parametrize("error", [
    RequestRejectedError("prompt 0 rejected: 20 prompt + 30 new tokens = 50 tokens can never fit",
                         field="max_new_tokens"),
    BeamSearchParamsError("BeamSearchParams.max_new_tokens must be >= 1", "max_new_tokens"),
])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_an_engine_refusal_of_max_new_tokens_names_the_clients_field(error, field):
    app = create_app(RefusingEngineThread(error), ServeMetrics("swa"), windowed())

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", timeout=10,
                                     json={"messages": MESSAGES, field: 30, **BEAM})

    got = asyncio.run(run())
    assert got.status_code == 400
    assert got.json()["error"]["param"] == field                 # never "max_new_tokens"
