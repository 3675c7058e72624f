"""A random workload run through a real cache and its manager, with a shadow copy of every
sequence's true keys and values.

K/V of token t of a sequence are a deterministic function of the sequence's token prefix
[0..t] (as in a real model), so sequences that share a prefix legitimately share cache memory,
and a wrongly shared or stale page shows up as a content mismatch. Everything lives on the
cache's device (the CPU, or CUDA in the GPU tests); the random draws are the same on both.

A cache in another ``kv_cache_dtype`` must hold exactly the encoding of the truth (its bytes,
with the scales its first writes fixed) whatever moved them (swap, copy-on-write, prefix hits),
and attention must equal dense fp32 attention over the decoded truth.
"""
from __future__ import annotations

import random

import torch

from vmemkv.runtime.attention import get_backend
from vmemkv.runtime.attention.reference import dense_attention
from vmemkv.runtime.kv import make_kv
from vmemkv.runtime.config import CacheConfig

VOCAB = 50


class ShadowRun:
    """Drive ``cache`` with random prefill/decode/fork/prefix/preempt/swap/free steps."""

    def __init__(self, config: CacheConfig, cache_kind: str, seed: int, backends=("sdpa",),
                 num_heads: int = 4, **cache_options) -> None:
        self.config = config
        self.cache = make_kv(config, cache_kind, **cache_options)
        self.manager = self.cache.manager
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        c = config
        self.device = c.torch_device
        # per token id: (layers, 2, kv_heads, head_dim); per prefix hash bucket: an offset
        self.table = torch.randn((VOCAB, c.num_layers, 2, c.num_kv_heads, c.head_dim),
                                 generator=gen).to(self.device)
        self.bucket = torch.randn((997, c.num_layers, 2, 1, 1), generator=gen).to(self.device)
        self.tokens: dict[int, list[int]] = {}          # running sequences -> token ids
        self.swapped: dict[int, list[int]] = {}          # swapped out -> token ids
        self.next_id = 0
        self.num_heads = num_heads
        self.backends = [get_backend(name) for name in backends]
        self.checked_attention = 0
        self.events = {"prefill": 0, "decode": 0, "fork": 0, "prefix_hit_tokens": 0,
                       "preempt_recompute": 0, "swap_out": 0, "swap_in": 0, "free": 0}

    # -- truth --
    def kv_truth(self, tokens: list[int]) -> torch.Tensor:
        """(tokens, layers, 2, kv_heads, head_dim) K/V of every position of a token list."""
        hashes, h = [], 17
        for token in tokens:
            h = (h * 1_000_003 + token) % 997
            hashes.append(h)
        ids = torch.tensor(tokens, device=self.device)
        return (self.table[ids] + self.bucket[torch.tensor(hashes, device=self.device)]).to(self.config.dtype)

    # -- random actions --
    def new_sequence(self) -> None:
        length = self.rng.randint(1, self.config.max_context * 3 // 4)
        if self.tokens and self.rng.random() < 0.4:  # share a prefix with a running sequence
            donor = self.tokens[self.rng.choice(list(self.tokens))]
            keep = self.rng.randint(0, len(donor))
            prompt = donor[:keep] + [self.rng.randrange(VOCAB) for _ in range(max(1, length - keep))]
        else:
            prompt = [self.rng.randrange(VOCAB) for _ in range(length)]
        prompt = prompt[: self.config.max_context * 3 // 4]
        if not self.manager.can_allocate(len(prompt), prompt):
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        hit = self.manager.allocate(seq_id, len(prompt), token_ids=prompt)
        self.events["prefix_hit_tokens"] += hit
        self.events["prefill"] += 1
        self.pending.append((seq_id, hit, len(prompt) - hit))
        self.tokens[seq_id] = prompt

    def grow(self, seq_id: int) -> None:
        token = self.rng.randrange(VOCAB)
        length = len(self.tokens[seq_id])
        if length >= self.config.max_context:
            self.finish(seq_id)
            return
        if not self.manager.can_append(seq_id, 1):
            self.preempt(seq_id)
            return
        self.manager.append(seq_id, 1, token_ids=[token])
        self.tokens[seq_id].append(token)
        self.pending.append((seq_id, length, 1))
        self.events["decode"] += 1

    def fork(self, parent: int) -> None:
        if not self.manager.can_fork(parent):
            return
        child, self.next_id = self.next_id, self.next_id + 1
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.events["fork"] += 1

    def preempt(self, seq_id: int) -> None:
        if self.manager.can_swap_out(seq_id) and self.rng.random() < 0.5:
            self.manager.swap_out(seq_id)
            self.swapped[seq_id] = self.tokens.pop(seq_id)
            self.events["swap_out"] += 1
        else:
            self.manager.free(seq_id)
            del self.tokens[seq_id]
            self.events["preempt_recompute"] += 1

    def finish(self, seq_id: int) -> None:
        self.manager.free(seq_id)
        del self.tokens[seq_id]
        self.events["free"] += 1

    def swap_in_some(self) -> None:
        for seq_id in list(self.swapped):
            if self.manager.can_swap_in(seq_id):
                self.manager.swap_in(seq_id)
                self.tokens[seq_id] = self.swapped.pop(seq_id)
                self.events["swap_in"] += 1

    # -- one step --
    def step(self) -> None:
        self.pending: list[tuple[int, int, int]] = []
        self.swap_in_some()
        for seq_id in list(self.tokens):
            roll = self.rng.random()
            if roll < 0.08:
                self.finish(seq_id)
            elif roll < 0.16:
                self.fork(seq_id)
        for seq_id in list(self.tokens):
            if any(p[0] == seq_id for p in self.pending) or seq_id not in self.tokens:
                continue
            self.grow(seq_id)
        if self.rng.random() < 0.6:
            self.new_sequence()
        self.pending = [p for p in self.pending if p[0] in self.tokens and p[2] > 0]
        self.cache.execute(self.manager.take_ops())
        self.manager.check_integrity()
        if self.pending:
            self.run_model_step()
        self.check_contents()

    def run_model_step(self) -> None:
        """Write this step's new K/V into every layer and check attention against the truth."""
        step = self.cache.begin_step(self.pending)
        truths = {seq_id: self.kv_truth(self.tokens[seq_id][:computed + new])
                  for seq_id, computed, new in self.pending}
        new_kv = torch.cat([truths[s][c:c + n] for s, c, n in self.pending])  # (T, L, 2, H, D)
        c = self.config
        total = new_kv.shape[0]
        q = torch.randn((total, self.num_heads, c.head_dim), dtype=torch.float32).to(self.device, c.dtype)
        for layer in range(c.num_layers):
            self.cache.write(layer, new_kv[:, layer, 0].contiguous(), new_kv[:, layer, 1].contiguous())
            view = self.cache.layer_view(layer)
            expected = torch.cat([   # in fp32 from the (possibly half or encoded) true K/V
                dense_attention(q[start:start + n].float(), self.decoded(truths[s][:, layer, 0], layer, 0),
                                self.decoded(truths[s][:, layer, 1], layer, 1), c.head_dim ** -0.5)
                for (s, _, n), start in zip(self.pending, step.lens.q_starts)])
            for backend in self.backends:
                got = backend.forward(q, view)
                tol = 1e-5 if c.dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
                self.checked_attention += 1

    def stored(self, x: torch.Tensor, layer: int, which: int) -> torch.Tensor:
        """What the cache must hold for true K (``which`` 0) or V (1) ``x`` of ``layer``."""
        scales, enc = self.cache.kv_scales, self.config.kv_encoding
        if scales is None:
            return x.to(enc.storage)
        return enc.quantize(x, (scales.k, scales.v)[which][layer])

    def decoded(self, x: torch.Tensor, layer: int, which: int) -> torch.Tensor:
        """The values attention sees for true ``x``: its stored encoding, decoded (fp32)."""
        scales, enc = self.cache.kv_scales, self.config.kv_encoding
        stored = self.stored(x, layer, which)
        return stored.float() if scales is None else enc.dequantize(stored, (scales.k, scales.v)[which][layer])

    def check_contents(self) -> None:
        bits = torch.uint8 if self.config.element_bytes == 1 else torch.int16 \
            if self.config.element_bytes == 2 else torch.int32   # equal bytes, NaN or not
        for seq_id, tokens in self.tokens.items():
            truth = self.kv_truth(tokens)
            for layer in range(self.config.num_layers):
                k, v = self.cache.read(seq_id, layer, len(tokens))
                for which, got in ((0, k), (1, v)):
                    want = self.stored(truth[:, layer, which], layer, which)
                    assert torch.equal(got.view(bits), want.view(bits)), \
                        f"seq {seq_id} layer {layer} {'KV'[which]} differs"

    def run(self, steps: int) -> dict:
        for _ in range(steps):
            self.step()
        return self.events
