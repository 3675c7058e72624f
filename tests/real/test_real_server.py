"""The official ``openai`` client against ``vmemkv serve`` on SmolLM2-135M-Instruct: chat
completions (streamed and not) and completions with logprobs, echo, penalties at 0 and a list of
prompts; every answer equals the Engine's (tokens, text, logprobs within 1e-4 nats)."""
from __future__ import annotations

import asyncio

import pytest

from .conftest import CONVERSATIONS, NEW_TOKENS

pytestmark = pytest.mark.real_model
openai = pytest.importorskip("openai")
NATS = 1e-4
MODEL = "smollm2-135m-instruct"


def _client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def _chat_all(server, stream: bool) -> list:
    async with _client(server) as client:
        async def one(messages):
            kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=NEW_TOKENS,
                          temperature=0, frequency_penalty=0.0, presence_penalty=0.0,
                          logprobs=True, top_logprobs=2)
            if not stream:
                done = await client.chat.completions.create(**kwargs)
                c = done.choices[0]
                return c.message.content, c.finish_reason, [t.logprob for t in c.logprobs.content]
            text, reason, logprobs, roles = "", None, [], []
            async for chunk in await client.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}):
                if not chunk.choices:
                    assert chunk.usage.completion_tokens > 0
                    continue
                c = chunk.choices[0]
                roles.append(c.delta.role)
                text += c.delta.content or ""
                reason = c.finish_reason or reason
                logprobs += [t.logprob for t in (c.logprobs.content if c.logprobs else [])]
            assert roles[0] == "assistant"
            return text, reason, logprobs
        return await asyncio.gather(*(one(m) for m in CONVERSATIONS))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_openai_chat_completions_equal_the_engine(real_server, engine_outputs, stream):
    got = asyncio.run(_chat_all(real_server, stream))
    for (text, reason, logprobs), out in zip(got, engine_outputs):
        sample = out.outputs[0]
        assert (text, reason) == (sample.text, sample.finish_reason)
        assert len(logprobs) == len(sample.logprobs)
        assert max(abs(a - e.logprob) for a, e in zip(logprobs, sample.logprobs)) <= NATS


def test_openai_completions_with_logprobs_echo_and_a_list_of_prompts(real_server, engine_outputs,
                                                                    real_model):
    """What lm-evaluation-harness sends for loglikelihood (echo, logprobs) and for generation."""
    _, tokenizer = real_model
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)
    prompts = [list(out.prompt_token_ids) for out in engine_outputs]
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=NEW_TOKENS,
                                     temperature=0, logprobs=2, echo=True, frequency_penalty=0,
                                     presence_penalty=0)
    assert len(done.choices) == len(prompts)
    for choice, out in zip(sorted(done.choices, key=lambda c: c.index), engine_outputs):
        sample = out.outputs[0]
        prompt_text = tokenizer.decode(list(out.prompt_token_ids))
        assert choice.text == prompt_text + sample.text
        assert choice.finish_reason == sample.finish_reason
        lp = choice.logprobs
        assert len(lp.tokens) == len(out.prompt_token_ids) + len(sample.token_ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in sample.logprobs]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) <= NATS
        assert all(max(top.values()) >= lp_ for top, lp_ in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=NEW_TOKENS,
                                              temperature=0, stream=True))
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(len(prompts))] == [o.outputs[0].text for o in engine_outputs]
