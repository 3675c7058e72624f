"""``--max-response-bytes``' bound counts completions' names of tokens (``TokenStrings.key``),
not only their text: the byte tokenizer's longest text is 6 JSON bytes ("\\u0001"), while a
byte above 0x7F is named "bytes:\\\\x80" (11) and ids decoded alike "token_id:255" (12)."""
from __future__ import annotations

import json

from vmemkv.runtime.serve.limits import FLOAT_JSON_BYTES, ResponseBounds
from vmemkv.runtime.serve.logprobs_format import TokenStrings

from ..engine.byte_tokenizer import byte_tokenizer


def test_a_completion_entry_bound_holds_the_longest_name_of_a_token():
    tok = byte_tokenizer()
    strings = TokenStrings(tok)
    names = [strings.key(i) for i in range(256)] + ["token_id:255"]
    longest = max(len(json.dumps(n, ensure_ascii=False).encode()) - 2 for n in names)
    assert longest == 12
    bound = ResponseBounds.of(tok, 256).completion
    assert bound.entry_bytes >= longest + FLOAT_JSON_BYTES + 4      # "NAME":F,
