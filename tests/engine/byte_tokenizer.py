"""A byte-level tokenizer whose token id is the byte's value (256 ids, no merges), for the tiny
random-weight models (vocabulary 256): every generated id decodes, and a CJK character is three
tokens, an emoji four, so every multi-byte path of incremental detokenization is exercised.
Built with the ``tokenizers`` library (GPT-2's byte-to-unicode alphabet); nothing is downloaded.
"""
from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _byte_chars() -> dict:
    """GPT-2's bytes_to_unicode: byte value -> the printable character standing for it."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.lru_cache(maxsize=None)
def byte_tokenizer(chat_template: bool = False) -> PreTrainedTokenizerFast:
    """ids == UTF-8 bytes; ``chat_template``: a small template (the built-ins have none)."""
    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast
