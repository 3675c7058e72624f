"""Calibrated 8-bit KV scales (``kv_scales="calibrate"``): fixed when the engine is built, from
an input no client chooses.

First-write scales (``kv_dtype.first_write_scales``) come from whichever prompt reaches a layer
first. On a server that is one client's prompt, and it sets every later request's precision;
in a batch, a prompt's tokens depend on what was batched beside it at start-up. Calibrated
scales apply the same rule (per KV head, amax of |x| over the tokens and head_dim, over the
encoding's max) to every K and V the model writes for ``CALIBRATION_CONVERSATION`` (read as
each layer's cache update receives them, so sliding-window layers count all the tokens, not
the last window - 1 their transformers cache keeps), run once on the model's own attention
before the engine takes it over:

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
from transformers import DynamicCache

from .errors import CacheConfigError
from .hf.attention import own_attention
from .kv_dtype import KVEncoding, KVScales, scales_of_amax

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


class _AmaxCache(DynamicCache):
    """The cache the model would make itself (``DynamicCache(config=...)``: sliding layers keep
    their window), which also keeps, per layer, the amax of |x| per KV head over every K and V
    written to it, and the shape of the last write ([batch, kv_heads, tokens, head_dim])."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.amax: dict = {}    # layer -> [K amax [kv_heads], V amax [kv_heads]]
        self.shapes: dict = {}  # layer -> the shape of its last K write

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.shapes[layer_idx] = tuple(key_states.shape)
        if key_states.dim() == 4:
            new = [x.detach().abs().float().amax(dim=(0, 2, 3))
                   for x in (key_states, value_states)]
            old = self.amax.setdefault(layer_idx, new)
            if old is not new:    # NaN propagates (refused below), as it does in amax
                self.amax[layer_idx] = [torch.maximum(a, b) for a, b in zip(old, new)]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.inference_mode()
def calibrated_kv_scales(model: torch.nn.Module, tokenizer, encoding: KVEncoding,
                         num_layers: int, num_kv_heads: int, max_tokens: int) -> KVScales:
    """The scales of each (layer, KV head) from every K and V ``model`` writes for the
    calibration input (one forward pass on its own attention, with a fresh transformers
    cache whose updates are read as they come: the amax of all the input's tokens, sliding
    layers included). CacheConfigError naming the model when it does not write ``num_layers``
    layers of ``num_kv_heads`` heads (K/V this engine would not store the same way), naming
    the layer whose K or V holds NaN or +-inf (no scale encodes them), or when the input is
    no tokens (a tokenizer that encodes it as none)."""
    vocab = model.config.get_text_config().vocab_size
    ids = calibration_ids(tokenizer, vocab, max_tokens)
    if not ids:     # the forward raised a RuntimeError about an embedding's float indices
        raise CacheConfigError(f"kv_scales='calibrate': no calibration tokens (the tokenizer "
                               f"encodes the input as none, or max_tokens is {max_tokens!r}); "
                               f"give kv_scales instead")
    device = next(model.parameters()).device
    cache = _AmaxCache(model.config)
    with own_attention(model):
        model(torch.tensor([ids], device=device), use_cache=True, cache=cache,
              logits_to_keep=1)      # K/V are what it reads: one row of logits
    shapes = [cache.shapes[i] for i in sorted(cache.shapes)]
    if sorted(cache.amax) != list(range(num_layers)) \
            or any(len(s) != 4 or s[1] != num_kv_heads for s in shapes):
        raise CacheConfigError(f"kv_scales='calibrate': {type(model).__name__} writes K of "
                               f"shapes {shapes[:2]}... for {len(shapes)} layers, not "
                               f"{num_layers} layers of [1, {num_kv_heads}, tokens, head_dim]; "
                               f"give kv_scales instead")
    for layer in range(num_layers):
        for name, amax in zip("KV", cache.amax[layer]):
            if not bool(torch.isfinite(amax).all()):
                raise CacheConfigError(f"kv_scales='calibrate': {type(model).__name__}'s "
                                       f"layer {layer} {name} holds NaN or +-inf on the "
                                       f"calibration input (per KV head amax {amax.tolist()}); "
                                       f"give kv_scales instead")
    k = [scales_of_amax(cache.amax[layer][0], encoding) for layer in range(num_layers)]
    v = [scales_of_amax(cache.amax[layer][1], encoding) for layer in range(num_layers)]
    return KVScales.of(torch.stack(k), torch.stack(v))
