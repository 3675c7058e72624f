"""A tokenizer with several named chat templates (tokenizer_config.json's list of {name,
template}: transformers makes ``tokenizer.chat_template`` a dict, as for Hermes-2-Pro or
Command-R) chats with its "default" one, as transformers' apply_chat_template and vLLM do.
Engine.chat handed the dict itself to apply_chat_template as the template: a ChatTemplateError
"TypeError: unhashable type: 'dict'" for every conversation (found by hunt 29)."""
from __future__ import annotations

import copy

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.chat import ChatTemplateError

from .byte_tokenizer import CHAT_TEMPLATE, byte_tokenizer
from .conftest import model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
TOOLS = "{{ 'tools: ' + messages[-1]['content'] }}"


def named_templates(templates: dict):
    tokenizer = copy.deepcopy(byte_tokenizer())   # the shared one keeps its single template
    tokenizer.chat_template = templates
    return tokenizer


def test_named_templates_chat_with_the_default_or_the_one_named():
    tokenizer = named_templates({"default": CHAT_TEMPLATE, "tool_use": TOOLS})
    want = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=False,
                                         add_generation_prompt=True)
    assert bytes(want) == b"<system>Be brief.\n<user>hi\n<assistant>"
    with Engine(model(), tokenizer, max_batch=2, max_context=64) as engine:
        params = SamplingParams(max_new_tokens=2)
        (default,) = engine.chat(MESSAGES, params)
        (tools,) = engine.chat(MESSAGES, params, chat_template="tool_use")
    assert list(default.prompt_token_ids) == want and len(default.outputs[0].token_ids) == 2
    assert bytes(tools.prompt_token_ids) == b"tools: hi"


def test_named_templates_without_a_default_are_refused_naming_them():
    tokenizer = named_templates({"rag": CHAT_TEMPLATE, "tool_use": TOOLS})
    with Engine(model(), tokenizer, max_batch=2, max_context=64) as engine:
        with pytest.raises(ChatTemplateError, match=r"no default.*\['rag', 'tool_use'\]"):
            engine.chat(MESSAGES, SamplingParams(max_new_tokens=2))
        assert not engine.has_unfinished()
