"""Calibrated 8-bit KV scales (``kv_scales="calibrate"``): fixed when the engine is built, from
an input no client chooses.

First-write scales (``kv_dtype.first_write_scales``) come from whichever prompt reaches a layer
first. On a server that is one client's prompt, and it sets every later request's precision;
in a batch, a prompt's tokens depend on what was batched beside it at start-up. Calibrated
scales apply the same rule (per KV head, amax of |x| over the tokens and head_dim, over the
encoding's max) to the K and V the model writes for ``CALIBRATION_CONVERSATION``, run once on
the model's own attention before the engine takes it over:

* through the tokenizer's chat template when it has one (so the template's special tokens,
  whose K/V are often the largest, are in range), else (or when the template refuses it) its
  plain encoding;
* without a tokenizer, ``CALIBRATION_TOKENS`` fixed ids (seed 0), the random-weight built-ins'
  stand-in for text;
* cut to the engine's ``max_context`` tokens.

A checkpoint's own scales still come first (``Engine``): "calibrate" replaces the first write
only.
"""
from __future__ import annotations

import torch

from .errors import CacheConfigError
from .hf.attention import own_attention
from .kv_dtype import KVEncoding, KVScales, first_write_scales

CALIBRATION_CONVERSATION = (
    {"role": "user", "content":
        "Can you explain how a hash table works, give a short Python example, and say when I "
        "should use one instead of a sorted list? Please keep it under 200 words."},
    {"role": "assistant", "content":
        "A hash table stores key-value pairs in an array of buckets. A hash function turns each "
        "key into a number, and that number modulo the array's length picks the bucket. Looking "
        "up a key repeats the same steps, so it takes constant time on average; when two keys "
        "land in one bucket, the table keeps both, in a short list or in the next free slot.\n\n"
        "In Python, the built-in dict is a hash table:\n\n"
        "    ages = {\"Ada\": 36, \"Alan\": 41}\n"
        "    ages[\"Grace\"] = 85\n"
        "    print(ages.get(\"Alan\", 0))   # 41\n\n"
        "Use a hash table when you need fast lookups, inserts and deletes by exact key, for "
        "example counting words in a 10,000-line log or caching results. Use a sorted list (with "
        "bisect) when you need order: the smallest or largest items, every key between 100 and "
        "250, or iteration in sorted order. A hash table cannot answer range questions without "
        "scanning every entry, and it uses more memory per item."},
)
CALIBRATION_TOKENS = 256   # without a tokenizer


def calibration_ids(tokenizer, vocab_size: int, max_tokens: int) -> list:
    """The token ids calibration runs (see the module's doc), at most ``max_tokens``."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(vocab_size, (CALIBRATION_TOKENS,), generator=gen).tolist()[:max_tokens]
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(list(CALIBRATION_CONVERSATION), tokenize=True,
                                                return_dict=False)
            return [int(i) for i in ids][:max_tokens]
        except Exception:    # a template that refuses this conversation (its roles): the text
            pass
    text = "\n\n".join(turn["content"] for turn in CALIBRATION_CONVERSATION)
    return [int(i) for i in tokenizer(text)["input_ids"]][:max_tokens]


@torch.inference_mode()
def calibrated_kv_scales(model: torch.nn.Module, tokenizer, encoding: KVEncoding,
                         num_layers: int, num_kv_heads: int, max_tokens: int) -> KVScales:
    """The scales of each (layer, KV head) from the K and V ``model`` writes for the
    calibration input (one forward pass on its own attention, with a fresh transformers
    cache). CacheConfigError naming the model when its cache does not hold ``num_layers``
    layers of ``num_kv_heads`` heads (K/V this engine would not store the same way)."""
    vocab = model.config.get_text_config().vocab_size
    ids = calibration_ids(tokenizer, vocab, max_tokens)
    device = next(model.parameters()).device
    with own_attention(model):
        out = model(torch.tensor([ids], device=device), use_cache=True)
    past = out["cache"] if "cache" in out else out["past_key_values"]   # transformers 5 / 4
    layers = getattr(past, "layers", None)
    shapes = [tuple(layer.keys.shape) for layer in layers or ()]
    if len(shapes) != num_layers or any(len(s) != 4 or s[1] != num_kv_heads for s in shapes):
        raise CacheConfigError(f"kv_scales='calibrate': {type(model).__name__}'s cache holds "
                               f"K of shapes {shapes[:2]}... for {len(shapes)} layers, not "
                               f"{num_layers} layers of [1, {num_kv_heads}, tokens, head_dim]; "
                               f"give kv_scales instead")
    # [1, kv_heads, tokens, head_dim] -> [tokens, kv_heads, head_dim], as the cache is written
    k = [first_write_scales(layer.keys[0].transpose(0, 1), encoding) for layer in layers]
    v = [first_write_scales(layer.values[0].transpose(0, 1), encoding) for layer in layers]
    return KVScales.of(torch.stack(k), torch.stack(v))
