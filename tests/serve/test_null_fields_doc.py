"""docs/usage.md names exactly the request fields where JSON null is the default (as if not
sent) and the fields where it is a 400; the server's own parsers answer so, field by field.
The doc said "the penalties" (``repetition_penalty`` is a 400) and left out ``model``,
``user``, ``cache_salt``, ``beam_width`` and chat's ``chat_template`` (all taken)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vmemkv.runtime.serve.chat import ChatCompletionRequest, parse_chat_request
from vmemkv.runtime.serve.errors import ApiError
from vmemkv.runtime.serve.protocol import CompletionRequest, parse_completion_request

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
APIS = {"completions": (CompletionRequest, parse_completion_request, {"prompt": [1]}),
        "chat": (ChatCompletionRequest, parse_chat_request,
                 {"messages": [{"role": "user", "content": "x"}]})}


def _documented():
    """({api: fields where null is the default}, {api: fields where null is a 400}) as the
    paragraph of docs/usage.md says: a clause "completions' ..." or "chat's ..." is that API's."""
    text = " ".join(USAGE.read_text().split())
    taken_text = re.search(r"JSON `null` is the field's default, as if it were not sent, in "
                           r"exactly these fields: (.*?)\. Null in any other field \((.*?)\)",
                           text)
    assert taken_text, "docs/usage.md no longer states the null rule field by field"
    taken, refused = {api: set() for api in APIS}, {api: set() for api in APIS}
    for found, clauses in ((taken, taken_text.group(1).split("; ")),
                           (refused, taken_text.group(2).split(", "))):
        for clause in clauses:
            apis = next((only for prefix, only in (("completions'", ["completions"]),
                                                   ("chat's", ["chat"]))
                         if clause.startswith(prefix)), list(APIS))
            names = re.findall(r"`(\w+)`", clause)
            if "use_beam_search" in names and "beam_width" in names:   # "beam_width with ..."
                names = ["beam_width"]
            for api in apis:
                found[api].update(names)
    return taken, refused


@pytest.mark.parametrize("api", list(APIS))
def test_null_is_taken_in_exactly_the_fields_the_doc_lists(api):
    model, parse, base = APIS[api]
    taken, refused = _documented()
    for field in model.model_fields:
        body = json.dumps({**base, field: None}).encode()
        try:
            parse(body)
            got = "taken"
        except ApiError as error:
            assert error.status == 400 and error.param == field, (field, error)
            got = "400"
        if field in base:
            assert got == "400" and field in refused[api], field
            continue
        assert field in taken[api] | refused[api], f"docs/usage.md: what does null in {field} do?"
        assert got == ("taken" if field in taken[api] else "400"), field
