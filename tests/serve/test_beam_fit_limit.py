"""A beam search's server limit is the engine's for its beam_width: tiny-mistral-swa on paged
8-token blocks, a 6-block (48-token) pool. The server held every beam search to the whole-length
bound (48 tokens) while the engine's add-time check counts each beam's own block beside the
blocks the group shares: 3 beams that run to max_tokens fit 33 tokens, 4 fit 25. So a chat beam
search of 3 beams over a 20-token prompt without max_tokens defaulted to 28 new tokens and the
engine refused it naming beam_width, and a completion asking 14 (34 tokens) passed the server's
check to be refused there the same way. Now ``ServedModel.limit_for``
asks the scheduler (``Scheduler.beam_fit_tokens``), which counts by ``check_beam_group_fits``'
own rule."""
from __future__ import annotations

import httpx
import pytest

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import RequestRejectedError
from vmemkv.runtime.models import build_model
from vmemkv.runtime.serve import Server
from vmemkv.runtime.serve.chat import chat_token_ids, parse_chat_request
from vmemkv.runtime.serve.completions import BeamShape, ServedModel

from . import local_http
from ..engine.byte_tokenizer import byte_tokenizer

OPTIONS = dict(cache="paged", block_size=8, cache_bytes=24 * 1024, max_context=256,
               max_batch=4, self_check=False)
MESSAGES = [{"role": "user", "content": "hi"}]      # 20 tokens rendered ("<user>hi\n<assistant>")
PROMPT = list(range(3, 23))                          # 20 tokens


@pytest.fixture(scope="module")
def server():
    with Engine(build_model("tiny-mistral-swa", seed=0), byte_tokenizer(chat_template=True),
                **OPTIONS) as engine:
        with Server(engine, "swa", host="127.0.0.1", port=0).start() as running:
            yield running, engine


# (beam_width, runs to max_tokens) -> prompt + max_tokens after a 20-token prompt
LIMITS = {(1, True): 48, (2, True): 48, (3, True): 33, (4, True): 25, (3, False): 48}


@pytest.mark.parametrize("width, runs", list(LIMITS))
def test_the_limit_for_a_beam_width_is_what_the_engine_accepts_and_one_more_is_refused(
        server, width, runs):
    _, engine = server
    limit = ServedModel.of(engine, "swa").limit_for(len(PROMPT), None, BeamShape(width, runs))
    assert limit == LIMITS[width, runs]
    stops = () if runs else (255,)      # a stop id may end it early: its first decode is checked
    params = BeamSearchParams(width, max_new_tokens=limit - len(PROMPT), ignore_eos=True,
                              stop_token_ids=stops)
    engine.abort(engine.add_beam_request(PROMPT, params))
    engine.run_until_done()
    with pytest.raises(RequestRejectedError) as refused:
        engine.add_beam_request(PROMPT, BeamSearchParams(width, ignore_eos=True,
                                                         max_new_tokens=limit + 1 - len(PROMPT),
                                                         stop_token_ids=stops))
    assert refused.value.field == ("max_new_tokens" if limit == 48 else "beam_width")
    assert not engine.has_unfinished()


def test_a_chat_beam_search_without_max_tokens_defaults_to_what_the_engine_accepts(server):
    _, engine = server
    body = {"messages": MESSAGES, "use_beam_search": True, "n": 3, "ignore_eos": True}
    req = parse_chat_request(httpx.Request("POST", "/", json=body).content)
    ids, max_tokens = chat_token_ids(req, ServedModel.of(engine, "swa"))
    assert len(ids) == 20 and max_tokens == 33 - 20                 # was 48 - 20, refused
    engine.abort(engine.add_beam_request(ids, req.sampling_params(max_tokens)))
    engine.run_until_done()
    with pytest.raises(RequestRejectedError, match="3 beams over a 20-token prompt") as refused:
        engine.add_beam_request(ids, req.sampling_params(max_tokens + 1))
    assert refused.value.field == "beam_width"


def test_a_completion_beam_search_past_its_width_limit_is_a_400_naming_max_tokens(server):
    running, _ = server
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 3, "ignore_eos": True}
    answer = local_http.post(running.url + "/v1/completions", json=dict(body, max_tokens=14), timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "max_tokens"                 # was beam_width, from the engine
    assert error["message"] == ("this model's context is 33 tokens for a beam search of "
                                "beam_width 3 after a 20-token prompt; the request asks for 34 "
                                "(20 in the prompt, 14 max_tokens)")
