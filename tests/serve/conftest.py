"""Serving fixtures: a tiny model behind a real server on a free 127.0.0.1 port (never another
address), and the engine's memory read back through public accessors."""
from __future__ import annotations

import contextlib
import functools
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

from vmemkv.runtime.engine import Engine  # noqa: E402
from vmemkv.runtime.kv import check_matches  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402
from vmemkv.runtime.serve import Server  # noqa: E402

KiB = 1024
VOCAB = 256
VMEM = dict(cache="vmem", page_bytes=4 * KiB, max_batch=8, max_context=64)
PAGED = dict(cache="paged", block_size=8, max_batch=8, max_context=64)
NAME = "tiny-llama"


@functools.lru_cache(maxsize=None)
def model():
    return build_model(NAME, seed=0)


@contextlib.contextmanager
def serving(options: dict, max_queue: int = 256, tokenizer=None, auth=None, limits=None):
    """(server, engine): the engine of ``options`` served on a free loopback port (``auth``:
    an AuthConfig, API keys; ``limits``: a ServeLimits)."""
    with Engine(model(), tokenizer, **options) as engine:
        with Server(engine, NAME, host="127.0.0.1", port=0, max_queue=max_queue,
                    auth=auth, limits=limits).start() as server:
            yield server, engine


def prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def assert_memory_at_baseline(engine) -> None:
    """Nothing held: no live tokens, every page group free or reclaimable (vmem) / every block
    free (paged), no swap space in use; manager and cache agree."""
    manager, cache = engine.cache.manager, engine.cache.cache
    stats = manager.stats()
    assert stats.live_tokens == 0 and stats.end_waste_tokens == 0
    reclaimable = manager.reclaimable_tokens if hasattr(manager, "reclaimable_tokens") else 0
    assert stats.free_tokens + reclaimable == stats.total_tokens
    assert cache.swapped_bytes == 0
    check_matches(manager, cache)


def wait_until_idle(server, timeout_s: float = 300.0) -> None:
    """Wait for every accepted request to end (aborts land between steps); the bound only
    turns a deadlock into a failure, it is no timing check (the work takes well under a second)."""
    import time
    deadline = time.monotonic() + timeout_s
    while server.engine_thread.pending_requests:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.01)
