"""The real model's shared state: a few chat prompts, transformers' own greedy answers, one vmem
engine run with logprobs and prompt logprobs (compared with those answers and reused by every
other test as "the Engine's"), and one server. Everything is session-scoped: SmolLM2-135M costs
~50 ms a token on one CPU thread, and the suite's budget is small."""
from __future__ import annotations

import functools

import pytest
import torch

from vmemkv.runtime.engine import Engine, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],     # EOS after 8 tokens
    [{"role": "user", "content": "Repeat exactly: 日本の首都は東京です 🙂"}],   # CJK out
    [{"role": "user", "content": "Write one emoji that means happy."}],   # 3-token emoji out
]
NEW_TOKENS = 12
ENGINE = dict(cache="vmem", max_batch=8, max_context=256)
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=2, prompt_logprobs=2)


@pytest.fixture(scope="session")
def chat_ids(real_model):
    _, tokenizer = real_model
    return [tokenizer.apply_chat_template(c, tokenize=True, return_dict=False,
                                          add_generation_prompt=True) for c in CONVERSATIONS]


@pytest.fixture(scope="session")
def reference(real_model_dir):
    """A second copy of the model left on transformers' own attention (engines switch theirs)."""
    from vmemkv.runtime.models import load_model
    return load_model(str(real_model_dir))[0]


@pytest.fixture(scope="session")
def hf_greedy(reference, chat_ids):
    """transformers' generate per prompt (default cache, no padding), EOS as the model says."""
    outs = []
    for ids in chat_ids:
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="session")
def real_engine(real_model):
    model, tokenizer = real_model
    with Engine(model, tokenizer, **ENGINE) as engine:
        yield engine


@pytest.fixture(scope="session")
def engine_run(real_engine, chat_ids):
    """The Engine's answers to the chat prompts, streamed: (outputs, each request's events)."""
    events: dict = {}
    for event in real_engine.stream(chat_ids, PARAMS):
        events.setdefault(event.request_id, []).append(event)
    return real_engine.last_outputs, [events[o.request_id] for o in real_engine.last_outputs]


@pytest.fixture(scope="session")
def engine_outputs(engine_run):
    """The Engine's answers: tokens, text, logprobs, prompt logprobs (what Engine.chat gives)."""
    return engine_run[0]


@pytest.fixture(scope="session")
def real_server(real_model):
    from vmemkv.runtime.serve import Server
    model, tokenizer = real_model
    with Engine(model, tokenizer, **ENGINE) as engine:
        with Server(engine, "smollm2-135m-instruct", port=0).start() as server:
            yield server


@functools.lru_cache(maxsize=None)
def forward_logprobs(model, ids: tuple) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0].float(), dim=-1)
