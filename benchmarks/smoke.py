"""Toy sizes for every section of the suite: ``vmemkv bench --smoke`` checks the plumbing
(every section runs; bench.json, bench.log, the plots and the summary appear) in seconds.

The figures of a smoke run mean nothing: heads of 16 dims, contexts of 64 tokens, yardsticks
over 4 MiB, 40 simulated requests, 8 engine requests of 2 new tokens on our two layouts and
transformers', and ``--prefix-eviction``'s chats cut to 2 of 2 turns (its quick 4 chats of 3
turns, each pass a new small-llama engine, took most of a 2-minute smoke run); bench.json's
environment says ``smoke: true``. The dry run of benchmarks/gpu_check.sh and the tests of the
suite use it; a real measurement never does.
"""
from __future__ import annotations

from typing import Callable

ATTENTION = dict(batches=[1, 2], contexts=[32, 64], heads=4, kv_heads=2, head_dim=16,
                 prefill_len=8, repeats=1)
YARDSTICK = dict(nbytes=4 << 20, matmul_n=128, repeats=1, fma_rounds=10_000)
MAPPER = dict(layers=2, kv_heads=8, head_dim=128, heads=16, batch=4, hidden=32,
              page_bytes=64 * 2**10, start_tokens=16, steps=6)
MEMORY_REQUESTS, MEMORY_PAGED_BLOCKS = 40, (16, 128)
MEMORY_VMEM_PAGES = {"per-layer": (64 * 2**10,), "interleaved": (2 * 2**20,)}
ENGINE_WORKLOAD = (8, 4, 16, 2)     # requests, shortest and longest prompt, new tokens
ENGINE_SYSTEMS = ("vmem per-layer", "paged bs16")   # (and transformers'): the two the summary compares
PREFIX_WORKLOAD = (2, 2, 32, 8, 4)  # chats, turns, system prompt, user message, answer (tokens):
                                    # the system prompt still fills 2 blocks of 16 to share


def apply(set_attribute: Callable = setattr) -> None:
    """Shrink every section's ``--quick`` configuration to the toy sizes above, by calling
    ``set_attribute(module, name, value)`` (``setattr``, or a test's ``monkeypatch.setattr``)."""
    from vmemkv.benchmarks import alloc, attention, engine, memory, prefix, suite
    set_attribute(suite, "SMOKE", True)   # bench.json says so (it said quick: true, no more)
    set_attribute(attention, "QUICK", dict(ATTENTION))
    set_attribute(attention, "QUICK_YARDSTICK", dict(YARDSTICK))
    set_attribute(alloc, "_mapper_shape", lambda quick, device: dict(MAPPER))
    set_attribute(memory, "QUICK_REQUESTS", MEMORY_REQUESTS)
    set_attribute(memory, "PAGED_BLOCKS", MEMORY_PAGED_BLOCKS)
    set_attribute(memory, "VMEM_PAGES", dict(MEMORY_VMEM_PAGES))
    set_attribute(engine, "QUICK_WORKLOAD", ENGINE_WORKLOAD)
    set_attribute(prefix, "QUICK", PREFIX_WORKLOAD)
    full = engine.configurations
    set_attribute(engine, "configurations", lambda quick, device="cpu": [
        (name, options) for name, options in full(quick, device) if name in ENGINE_SYSTEMS])
