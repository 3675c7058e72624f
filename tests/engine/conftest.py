"""Shared fixtures: tiny random-weight models (built once) and transformers' own greedy outputs."""
from __future__ import annotations

import functools
import random

import pytest
import torch

pytest.importorskip("transformers")

from vmemkv.runtime.models import build_model  # noqa: E402

from .near_tie import hf_greedy_with_margins, near_tie_mismatches  # noqa: E402

FAMILIES = ("tiny-llama", "tiny-qwen2")
VOCAB = 256


@functools.lru_cache(maxsize=None)
def model(name: str = "tiny-llama"):
    """The model engines run (an Engine switches it to the vmemkv attention function)."""
    return build_model(name, seed=0)


@functools.lru_cache(maxsize=None)
def reference_model(name: str):
    """Same weights (same seed), left on transformers' default attention for the reference."""
    return build_model(name, seed=0)


def prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


@functools.lru_cache(maxsize=None)
def _hf_greedy(name: str, prompt: tuple, max_new_tokens: int, ignore_eos: bool) -> tuple:
    """(tokens, the top-two logit margin at each of them)."""
    m = reference_model(name)
    saved = m.generation_config.eos_token_id
    if ignore_eos:   # None in a passed config means "the model's default", so clear the default
        m.generation_config.eos_token_id = None
    try:
        tokens, margins = hf_greedy_with_margins(m, [list(prompt)], max_new_tokens)
    finally:
        m.generation_config.eos_token_id = saved
    return tuple(tokens[0]), tuple(margins[0])


def hf_greedy(name: str, batch: list[list[int]], max_new_tokens: int,
              ignore_eos: bool = False) -> list[list[int]]:
    """transformers' generate (default cache, one prompt at a time: no padding) per prompt."""
    return [list(_hf_greedy(name, tuple(p), max_new_tokens, ignore_eos)[0]) for p in batch]


def greedy_problems(name: str, prompt, got, max_new_tokens: int, whole: bool = True) -> list[str]:
    """Why ``got`` is not transformers' greedy continuation of ``prompt`` (eos ignored) up to a
    near-tie (near_tie.py); empty when it is. For prompts a test draws at random, where the
    random-weight models' top two logits can tie within rounding (seen: 3e-6 apart).
    ``whole`` False: ``got`` may stop early (an aborted or failed request's tokens)."""
    want, margins = _hf_greedy(name, tuple(prompt), max_new_tokens, True)
    n = len(want) if whole else min(len(got), len(want))
    return near_tie_mismatches([list(got)], [list(want[:n])], [margins[:n]])


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def engine_state(engine) -> tuple:
    """Everything a rolled-back step must leave as it was, read through public accessors:
    the scheduler's queues, sequences and counters, the manager's accounting and tables, and
    memory (mappings, pool, swap space, every running sequence's cached K/V)."""
    sched, cache = engine.scheduler, engine.cache
    mgr, m = cache.manager, sched.metrics
    queues = tuple(tuple(s.seq_id for s in q) for q in (sched.waiting, sched.running, sched.swapped))
    seqs = {i: (s.state, s.num_computed, s.held, s.admit_order, tuple(s.output))
            for i, s in sched.seqs.items()}
    counters = (m.num_preemptions, m.num_swap_preemptions, m.recomputed_tokens,
                m.generated_tokens, sched.has_unfinished(), mgr.prefix_queries, mgr.prefix_hits)
    running = [s.seq_id for s in sched.running]
    tables = ({i: mgr.num_tokens(i) for i in running},
              [mgr.mapped_pages(slot) for slot in range(mgr.num_slots)]
              if hasattr(mgr, "mapped_pages") else [mgr.block_table(i) for i in running])
    kv = {(i, layer): tuple(t.numpy().tobytes() for t in cache.read(i, layer, sched.seqs[i].num_computed))
          for i in running for layer in range(cache.config.num_layers)}
    memory = (cache.range.mapped_pages() if hasattr(cache, "range") else None, cache.swapped_bytes)
    return queues, seqs, counters, mgr.stats(), tables, memory, kv
