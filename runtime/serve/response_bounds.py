"""A streamed response's bytes beyond a JSON response's (``limits.TokenBytes``): each token
travels in an SSE chunk of its own, ``data: {"id": ..., "object": ..., "created": ..., "model":
..., "choices": [{...}]}`` and a blank line, whose JSON has a space after every "," and ":".

The envelope is measured from the code that builds a chunk (``protocol.envelope`` and
``protocol.sse``) with the longest id, ``created`` and model id a chunk can carry; its one
choice's keys are ``TokenBytes.choice_bytes``, as a JSON response's choices are. The first
chunks (chat's roles) and the usage chunk are two envelopes more, once a response. A token's
own JSON gains one space a separator: its id's (several ids share a chunk's ``token_ids`` when
logprobs hold one back), and with logprobs each list's and entry's ("S": F in completions;
token, logprob, bytes and their list's in chat, a byte at most every 4 of an entry's bound,
whose ``bytes`` list takes 4 a byte: "255,").
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from . import protocol
from .limits import TokenBytes

CHUNK_ID = "chatcmpl-" + "f" * 32          # the longer of the two ids' shapes (uuid4().hex)
CREATED_S = 2**63 - 1                      # no Unix time is longer
# a model id the request does not say: a LoRA adapter's name is at most 256 characters
MODEL_ID_CHARS = 256
WIDEST_CHAR = "\U0010ffff"                 # 4 UTF-8 bytes
# spaces a token's logprobs gain (its lists' separators) and each entry's, beyond its bytes'
COMPLETION_SPACES = (4, 2)   # tokens, token_logprobs, text_offset, top_logprobs; "S": F,
CHAT_SPACES = (3, 6)         # content's ", " and top_logprobs'; token, logprob, bytes and ","


def chunk_envelope_bytes(kind: str, model_id: Optional[str]) -> int:
    """The bytes of one stream chunk of ``kind`` without its choice: ``model_id`` None counts
    the longest adapter name at 4 bytes a character."""
    model = model_id if model_id is not None else WIDEST_CHAR * MODEL_ID_CHARS
    return len(protocol.sse(protocol.envelope(CHUNK_ID, kind, model, CREATED_S, [])).encode())


def stream_bound(bound: TokenBytes, chat: bool, model_id: Optional[str]) -> TokenBytes:
    """``bound`` for a streamed response: each token one chunk more (its envelope and its
    choice's keys) and its separators' spaces, and the first and usage chunks' envelopes once."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    envelope_bytes = chunk_envelope_bytes(kind, model_id)
    logprobs_spaces, entry_spaces = CHAT_SPACES if chat else COMPLETION_SPACES
    if chat:                                  # its bytes list's ", ": one a byte at most
        entry_spaces += bound.entry_bytes // 4
    return replace(bound, token_bytes=bound.token_bytes + envelope_bytes + bound.choice_bytes + 1,
                   logprobs_bytes=bound.logprobs_bytes + logprobs_spaces,
                   entry_bytes=bound.entry_bytes + entry_spaces,
                   envelope_bytes=bound.envelope_bytes + 2 * envelope_bytes)
