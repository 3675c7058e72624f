"""A cache, its manager and a shadow copy of every sequence's true K/V, driven one step at a time.

Each step is one manager action (admit, grow, fork, preempt, swap in, free) run through
``run_plan`` (mutate manager, execute ops, commit or roll back), then the step's new tokens are
written into every layer. ``check()`` asserts the manager's and the cache's integrity and that
every resident sequence's cached K/V, and every swapped sequence's host copy, equal the truth.

K/V of token t is a function of the token prefix [0..t] (as in a real model), so sequences that
share a prefix legitimately share pages and a stale or wrongly shared page is a content mismatch.
"""
from __future__ import annotations

import torch

from vmemkv.runtime.kv import make_kv
from tests.runtime.run_plan import run_plan
from vmemkv.runtime.config import CacheConfig
from vmemkv.vmem.faults import FaultInjectingDriver
from vmemkv.vmem.host import HostDriver

from ..scheduler.shadow import dump as canon  # noqa: F401 (a plain copy of manager state)

KiB = 2**10
VOCAB = 7          # small: prompts that share prefixes are common


def small_config(max_batch: int = 4, max_context: int = 64) -> CacheConfig:
    # per layer and token 2 heads * 16 dims * 4 B = 128 B: a 4 KiB page holds 32 tokens
    # per-layer, 16 interleaved (2 layers)
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=max_batch,
                       max_context=max_context)


def straddling_config(max_batch: int = 4, max_context: int = 128) -> CacheConfig:
    # per layer and token 3 heads * 16 dims * 4 B = 192 B: no 4 KiB page holds whole tokens, a
    # member spans 3 pages (a group holds 64 tokens per-layer, 32 interleaved) backed by bytes
    return CacheConfig(num_layers=2, num_kv_heads=3, head_dim=16, max_batch=max_batch,
                       max_context=max_context)


LAYOUTS = {
    "vmem-per-layer": ("vmem", dict(layout="per-layer", page_bytes=4 * KiB)),
    "vmem-interleaved": ("vmem", dict(layout="interleaved", page_bytes=4 * KiB)),
    "vmem-per-layer-mapper": ("vmem", dict(layout="per-layer", page_bytes=4 * KiB,
                                           background_mapper=True)),
    "vmem-interleaved-mapper": ("vmem", dict(layout="interleaved", page_bytes=4 * KiB,
                                             background_mapper=True)),
    "paged": ("paged", dict(block_size=8)),
    "vmem-straddling-mapper": ("vmem", dict(layout="per-layer", page_bytes=4 * KiB,
                                            background_mapper=True)),
    "vmem-interleaved-straddling": ("vmem", dict(layout="interleaved", page_bytes=4 * KiB)),
    # block-granular prefix hits (blocks of 8 tokens; 4 a page per-layer, 2 interleaved, 8 a
    # straddling group), published as they are computed
    "vmem-blocks-per-layer": ("vmem", dict(layout="per-layer", page_bytes=4 * KiB, block_size=8)),
    "vmem-blocks-interleaved": ("vmem", dict(layout="interleaved", page_bytes=4 * KiB,
                                             block_size=8)),
    "vmem-blocks-straddling": ("vmem", dict(layout="per-layer", page_bytes=4 * KiB,
                                            block_size=8)),
}
CONFIGS = {"vmem-straddling-mapper": straddling_config,          # default: small_config
           "vmem-interleaved-straddling": straddling_config,
           "vmem-blocks-straddling": straddling_config}
PUBLISHING = {"vmem-blocks-per-layer", "vmem-blocks-interleaved", "vmem-blocks-straddling"}


class CacheModel:
    """One cache + manager + truth. ``layout`` is a key of LAYOUTS."""

    def __init__(self, layout: str, *, config: CacheConfig | None = None,
                 cache_fraction: float = 2.5, swap_seqs: float = 2.0, delay=None) -> None:
        kind, options = LAYOUTS[layout]
        self.config = c = config or CONFIGS.get(layout, small_config)()
        self.driver = FaultInjectingDriver(HostDriver(), delay=delay) if kind == "vmem" else None
        extra = {"driver": self.driver} if kind == "vmem" else {}
        self.cache = make_kv(c, kind, cache_bytes=int(cache_fraction * c.max_context * c.bytes_per_token),
                                swap_bytes=int(swap_seqs * c.max_context * c.bytes_per_token),
                                **options, **extra)
        self.manager = self.cache.manager
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn((VOCAB, c.num_layers, 2, c.num_kv_heads, c.head_dim), generator=gen)
        self.bucket = torch.randn((101, c.num_layers, 2, 1, 1), generator=gen)
        self.tokens: dict[int, list[int]] = {}     # resident -> token ids
        self.swapped: dict[int, list[int]] = {}    # swapped out -> token ids
        self.next_id = 0
        self.events: dict[str, int] = {}
        # mark every written token computed (the engine's publish on compute); checks that no
        # write and no copy lands in a page another sequence holds
        self.publishing = layout in PUBLISHING

    # -- truth --
    def truth(self, tokens: list[int]) -> torch.Tensor:
        """(tokens, layers, 2, kv_heads, head_dim)."""
        hashes, h = [], 17
        for token in tokens:
            h = (h * 1_000_003 + token) % 101
            hashes.append(h)
        return (self.table[torch.tensor(tokens)] + self.bucket[torch.tensor(hashes)]).to(self.config.dtype)

    def count(self, event: str) -> None:
        self.events[event] = self.events.get(event, 0) + 1

    # -- actions: each returns a mutate() for run_plan, which returns the writes to do --
    def admit(self, prompt: list[int]):
        def mutate():
            if not prompt or not self.manager.can_allocate(len(prompt), prompt):
                return None
            seq_id = self.next_id
            hit = self.manager.allocate(seq_id, len(prompt), token_ids=prompt)
            return ("admit", seq_id, list(prompt), [(seq_id, hit, len(prompt) - hit)])
        return mutate

    def grow(self, seq_id: int, new_ids: list[int]):
        def mutate():
            if len(self.tokens[seq_id]) + len(new_ids) > self.config.max_context:
                return None
            if not self.manager.can_append(seq_id, len(new_ids)):
                return None
            old = len(self.tokens[seq_id])
            self.manager.append(seq_id, len(new_ids), token_ids=new_ids)
            return ("grow", seq_id, new_ids, [(seq_id, old, len(new_ids))])
        return mutate

    def fork(self, parent: int):
        def mutate():
            if not self.manager.can_fork(parent):
                return None
            self.manager.fork(parent, self.next_id)
            return ("fork", parent, None, [])
        return mutate

    def preempt(self, seq_id: int, swap: bool):
        def mutate():
            if swap and self.manager.can_swap_out(seq_id):
                self.manager.swap_out(seq_id)
                return ("swap_out", seq_id, None, [])
            self.manager.free(seq_id)
            return ("free", seq_id, None, [])
        return mutate

    def swap_in(self, seq_id: int):
        def mutate():
            if not self.manager.can_swap_in(seq_id):
                return None
            self.manager.swap_in(seq_id)
            return ("swap_in", seq_id, None, [])
        return mutate

    def free(self, seq_id: int):
        def mutate():
            self.manager.free(seq_id)
            return ("free", seq_id, None, [])
        return mutate

    # -- one step --
    def step(self, mutate) -> None:
        """Run one action as a plan, update the shadow, write the new tokens."""
        ops: list = []

        def mutate_and_look():
            out = mutate()
            ops.extend(self.manager._ops)    # what take_ops is about to hand the cache
            return out
        outcome = run_plan(self.manager, self.cache, mutate_and_look)
        if outcome is None:
            return
        kind, seq_id, ids, writes = outcome
        self.check_private(ops, [w for w in writes if w[2] > 0])
        self.count(kind)
        if kind == "admit":
            self.tokens[seq_id] = ids
            self.next_id += 1
        elif kind == "grow":
            self.tokens[seq_id] = self.tokens[seq_id] + ids
        elif kind == "fork":
            self.tokens[self.next_id] = list(self.tokens[seq_id])
            self.next_id += 1
        elif kind == "swap_out":
            self.swapped[seq_id] = self.tokens.pop(seq_id)
        elif kind == "swap_in":
            self.tokens[seq_id] = self.swapped.pop(seq_id)
        elif kind == "free":
            self.tokens.pop(seq_id, None)
            self.swapped.pop(seq_id, None)
        writes = [w for w in writes if w[2] > 0]
        if writes:
            self.write(writes)
        if self.publishing:
            for s, c, n in writes:
                self.manager.mark_computed(s, c + n)

    def check_private(self, ops, writes) -> None:
        """No copy's destination and no written token is in a page group another sequence
        holds (a shared page is never written)."""
        if not self.publishing:
            return
        m, tpp = self.manager, self.manager.tokens_per_page
        for op in ops:
            if type(op).__name__ == "CopyExtent":
                g = m.mapped_pages(op.dst_slot)[op.dst_page_index]
                assert m._refs[g] == 1, ("copy into a shared group", op)
                if op.num_tokens is not None:
                    self.count("block_copy")
        for s, c, n in writes:
            units = m._seq(s).units
            for pi in range(c // tpp, -(-(c + n) // tpp)):
                assert m._refs[units[pi]] == 1, ("write into a shared group", s, pi)

    def write(self, writes: list[tuple[int, int, int]]) -> None:
        self.cache.begin_step(writes)
        kv = torch.cat([self.truth(self.tokens[s])[c:c + n] for s, c, n in writes])  # (T, L, 2, H, D)
        for layer in range(self.config.num_layers):
            self.cache.write(layer, kv[:, layer, 0].contiguous(), kv[:, layer, 1].contiguous())

    # -- checks --
    def check(self) -> None:
        self.cache.check_integrity()
        assert set(self.tokens) == set(self.manager._seqs), "resident sequences"
        assert set(self.swapped) == set(self.manager._swapped), "swapped sequences"
        for seq_id, tokens in self.tokens.items():
            assert self.manager.num_tokens(seq_id) == len(tokens)
            truth = self.truth(tokens)
            for layer in range(self.config.num_layers):
                first, k, v = self.read_held(seq_id, layer, len(tokens))
                assert torch.equal(k, truth[first:, layer, 0]), f"seq {seq_id} layer {layer} K differs"
                assert torch.equal(v, truth[first:, layer, 1]), f"seq {seq_id} layer {layer} V differs"
        for seq_id, tokens in self.swapped.items():
            buffer = self.cache._swapped[seq_id]          # (layers, 2, tokens, heads, dim)
            assert torch.equal(buffer, self.truth(tokens).permute(1, 2, 0, 3, 4)), f"swapped {seq_id}"

    def read_held(self, seq_id: int, layer: int, num_tokens: int) -> tuple:
        """(first, K, V) of the tokens [first, num_tokens) of ``layer`` the cache still holds:
        all of them, except a hybrid pool's windowed layer behind its window (first = the
        first page whose WINDOW part is mapped)."""
        cache = self.cache.cache
        if cache.kind != "vmem" or len(cache.kinds) == 1 or self.config.window_of(layer) is None:
            return (0, *self.cache.read(seq_id, layer, num_tokens))
        slot = self.manager.slot_of(seq_id)
        kind = next(name for name, layers in cache.kinds if layer in layers)
        held = [pi for pi, extents in cache.mapped_extents(slot).items() if kind in extents]
        first = min(min(held, default=0) * cache.tokens_per_page, num_tokens)
        k, v = cache.layer_tensors(layer)
        return first, k[slot, first:num_tokens].clone(), v[slot, first:num_tokens].clone()

    def snapshot(self) -> dict:
        """Everything a failed plan must leave unchanged: manager tables and counters, what is
        mapped where, pool counts, swap space, and (via check) contents."""
        self.cache.wait_for_plan()
        state = {"manager": canon({k: v for k, v in vars(self.manager).items() if k != "model"}),
                 "swapped": sorted(self.cache._swapped)}
        cache = self.cache
        if hasattr(cache, "range"):
            state["mapped"] = cache.range.mapped_pages()
            state["pool_free"] = cache.pool.free_pages
            state["map_counts"] = [cache.pool.mapping_count(p) for p in range(cache.pool.total_pages)]
            state["driver_mapped"] = self.driver.mapped_addresses
        return state

    def close(self) -> None:
        self.cache.close()
