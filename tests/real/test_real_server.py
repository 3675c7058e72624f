"""The official ``openai`` client against ``vmemkv serve`` on SmolLM2-135M-Instruct: chat
completions (streamed and not) and completions with logprobs, echo, penalties at 0 and a list of
prompts; every answer equals the Engine's (tokens, text, logprobs within 1e-4 nats). The
requests go out together (they batch on the server: one run's cost), each test reads its part."""
from __future__ import annotations

import asyncio

import pytest

from .conftest import CONVERSATIONS, NEW_TOKENS

pytestmark = pytest.mark.real_model
openai = pytest.importorskip("openai")
NATS = 1e-4
MODEL = "smollm2-135m-instruct"
CHAT = dict(model=MODEL, max_completion_tokens=NEW_TOKENS, temperature=0, frequency_penalty=0.0,
            presence_penalty=0.0, logprobs=True, top_logprobs=2)


async def _chat(client, messages) -> tuple:
    done = await client.chat.completions.create(messages=messages, **CHAT)
    c = done.choices[0]
    return c.message.content, c.finish_reason, [t.logprob for t in c.logprobs.content]


async def _chat_stream(client, messages) -> tuple:
    text, reason, logprobs, roles, usage = "", None, [], [], None
    async for chunk in await client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **CHAT):
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        roles.append(c.delta.role)
        text += c.delta.content or ""
        reason = c.finish_reason or reason
        logprobs += [t.logprob for t in (c.logprobs.content if c.logprobs else [])]
    assert roles[0] == "assistant" and usage.completion_tokens == len(logprobs)
    return text, reason, logprobs


@pytest.fixture(scope="module")
def answers(real_server, engine_outputs):
    """Every request at once: chats (JSON and SSE) and one completions call with the prompts."""
    prompts = [list(out.prompt_token_ids) for out in engine_outputs]

    async def run():
        async with openai.AsyncOpenAI(base_url=real_server.url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            completions = client.completions.create(
                model=MODEL, prompt=prompts, max_tokens=NEW_TOKENS, temperature=0, logprobs=2,
                echo=True, frequency_penalty=0, presence_penalty=0)
            results = await asyncio.gather(*(_chat(client, m) for m in CONVERSATIONS),
                                           *(_chat_stream(client, m) for m in CONVERSATIONS),
                                           completions)
        n = len(CONVERSATIONS)
        return {"json": results[:n], "sse": results[n:2 * n], "completions": results[-1]}
    return asyncio.run(run())


@pytest.mark.parametrize("stream", ["json", "sse"])
def test_openai_chat_completions_equal_the_engine(answers, engine_outputs, stream):
    for (text, reason, logprobs), out in zip(answers[stream], engine_outputs):
        sample = out.outputs[0]
        assert (text, reason) == (sample.text, sample.finish_reason)
        assert len(logprobs) == len(sample.logprobs)
        assert max(abs(a - e.logprob) for a, e in zip(logprobs, sample.logprobs)) <= NATS


def test_openai_completions_with_logprobs_echo_and_a_list_of_prompts(answers, engine_outputs,
                                                                    real_model):
    """What lm-evaluation-harness sends for loglikelihoods: echo, logprobs, token-id prompts."""
    _, tokenizer = real_model
    done = answers["completions"]
    assert len(done.choices) == len(engine_outputs)
    for choice, out in zip(sorted(done.choices, key=lambda c: c.index), engine_outputs):
        sample = out.outputs[0]
        assert choice.text == tokenizer.decode(list(out.prompt_token_ids)) + sample.text
        assert choice.finish_reason == sample.finish_reason
        lp = choice.logprobs
        assert len(lp.tokens) == len(out.prompt_token_ids) + len(sample.token_ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in sample.logprobs]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) <= NATS
        assert all(max(top.values()) >= chosen   # the likeliest is listed, and the chosen token
                   for top, chosen in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
