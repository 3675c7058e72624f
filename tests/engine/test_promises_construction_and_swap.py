"""Two gaps in the process-wide memory promises (runtime/memory.py), each closed here:

* construction: two engines built at once in two threads both passed their check against the
  same bytes (a resize held ``PROMISES_LOCK`` across its check and size change, construction
  did not). Now a construction holds it from its first check until the engine is tracked.
* swap space: the host memory ``swap_bytes`` holds aside for swapped-out sequences is filled
  on demand (a buffer at each swap-out), so what is not filled yet is a promise on the host
  like a grown pool's unmapped pages; another engine's check and a resize ignored it.

Available and total memory are faked (memory's meminfo reader, monkeypatched): nothing here
depends on this machine's memory, and nothing allocates more than a few hundred KiB."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from vmemkv.runtime import memory
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine import engine as engine_module
from vmemkv.runtime.errors import CacheTooLargeError, PlanExecutionError
from vmemkv.scheduler.errors import CacheResizeError

from ..vmem_only_options import options_for
from .conftest import model

KiB = 1024
HOST = torch.device("cpu")
OPTS = dict(max_batch=4, max_context=512, max_tokens_per_step=8, self_check=False)
SAFETY_NET_S = 60.0     # only a deadlock would wait this long; no assertion depends on it


def _engine(cache: str = "vmem", **options) -> Engine:
    options = {**OPTS, **options_for(cache, page_bytes=4096, layout="per-layer"), **options}
    return Engine(model(), cache=cache, **options)


@pytest.fixture
def host(monkeypatch):
    """The host's meminfo as this test says: ``host["available"]`` bytes MemAvailable (less
    ``host["built"]``, the caches built so far, when the test counts them), 8 MiB MemTotal;
    no engine of an earlier test promising anything."""
    gc.collect()
    assert memory.promised_bytes(HOST) == 0, "an earlier test left an engine promising memory"
    state = {"available": 1024 * KiB, "built": 0}
    fields = {"MemTotal": lambda: 8192 * KiB,
              "MemAvailable": lambda: state["available"] - state["built"]}
    monkeypatch.setattr(memory, "meminfo_bytes", lambda field: fields[field]())
    return state


class AskedLock:
    """``PROMISES_LOCK`` as it is, setting ``asked`` when the thread named ``who`` asks for it
    (before it waits), so a test knows that thread reached the lock without a sleep."""

    def __init__(self, lock, who: str, asked: threading.Event) -> None:
        self.lock, self.who, self.asked = lock, who, asked

    def __enter__(self):
        if threading.current_thread().name == self.who:
            self.asked.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_two_engines_built_at_once_never_both_pass_against_the_same_bytes(host, monkeypatch):
    """The first has passed its check and is about to build its 640 KiB when the second starts:
    the second checks only once the first is built (1 MiB less 640 KiB left: refused). Before,
    both passed against the same 1 MiB and 1280 KiB of caches were built."""
    at_build, second_moved = threading.Event(), threading.Event()
    monkeypatch.setattr(memory, "PROMISES_LOCK",
                        AskedLock(memory.PROMISES_LOCK, "second", second_moved))
    real_make_kv = engine_module.make_kv

    def make_kv(*args, **kwargs):
        if threading.current_thread().name == "first":
            at_build.set()        # its checks passed; let the second go as far as it can
            assert second_moved.wait(SAFETY_NET_S)
        else:
            second_moved.set()    # the second passed its checks too (it never waited)
        kv = real_make_kv(*args, **kwargs)
        host["built"] += kwargs["cache_bytes"]       # the reading drops as a cache is made
        return kv

    monkeypatch.setattr(engine_module, "make_kv", make_kv)
    engines, errors = {}, {}

    def build(name: str) -> None:
        try:
            engines[name] = _engine(cache_bytes=640 * KiB)
        except Exception as error:       # reported below, whichever it is
            errors[name] = error

    first = threading.Thread(target=build, args=("first",), name="first")
    second = threading.Thread(target=build, args=("second",), name="second")
    try:
        first.start()
        assert at_build.wait(SAFETY_NET_S)
        second.start()
        first.join(SAFETY_NET_S)
        second.join(SAFETY_NET_S)
        assert not first.is_alive() and not second.is_alive()
        assert sorted(engines) == ["first"] and sorted(errors) == ["second"], (engines, errors)
        assert isinstance(errors["second"], CacheTooLargeError)
        message = str(errors["second"])
        for words in ("needs 655360 bytes", "MemAvailable is 393216 bytes"):
            assert words in message, (words, message)
        assert host["built"] == 640 * KiB               # one cache, never two
        out = engines["first"].generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        for engine in engines.values():
            engine.close()


def test_a_construction_that_builds_and_resizes_another_engine_inside_does_not_deadlock(
        host, monkeypatch):
    """The lock is the resize's reentrant one: a construction that builds a second engine and
    resizes it on the same thread (here from inside the first's cache build) goes on."""
    real_make_kv, inner = engine_module.make_kv, []

    def make_kv(*args, **kwargs):
        if not inner:
            inner.append(None)
            inner[0] = _engine(cache_bytes=64 * KiB, max_cache_bytes=256 * KiB)
            assert inner[0].resize_cache(192 * KiB) == 192 * KiB
        return real_make_kv(*args, **kwargs)

    monkeypatch.setattr(engine_module, "make_kv", make_kv)
    with _engine(cache_bytes=64 * KiB) as outer:
        with inner[0]:
            assert (outer.cache_bytes, inner[0].cache_bytes) == (64 * KiB, 192 * KiB)
            assert memory.promised_bytes(HOST) == 128 * KiB     # the inner's grow, unmapped
    assert memory.promised_bytes(HOST) == 0


SWAP = dict(preemption="swap", swap_bytes=512 * KiB)


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_an_engines_unfilled_swap_space_is_a_promise_other_checks_leave_out(host, cache):
    """A 512 KiB swap space on a 1 MiB host: another engine's 576 KiB cache was built (and a
    64 KiB one grew to 640 KiB) beside it; now both are refused, naming the promise."""
    with _engine(cache, cache_bytes=64 * KiB, **SWAP) as a:
        assert a.promised_bytes(HOST) == memory.promised_bytes(HOST) == 512 * KiB
        with pytest.raises(CacheTooLargeError) as info:
            _engine(cache_bytes=576 * KiB)
        for words in ("needs 589824 bytes", "MemAvailable (1048576 bytes) less the 524288 "
                      "bytes other KV pools in this process promised", "swap spaces not filled yet",
                      "is 524288 bytes"):
            assert words in str(info.value), (words, str(info.value))
        assert memory.promised_bytes(HOST) == 512 * KiB        # the refused one promised nothing
        with _engine(cache_bytes=64 * KiB, max_cache_bytes=1024 * KiB) as b:
            with pytest.raises(CacheResizeError) as grow:       # 576 KiB unmapped > 1024 - 512
                b.resize_cache(640 * KiB)
            assert "less the 524288 bytes other KV pools" in str(grow.value)
            assert b.cache_bytes == 64 * KiB and b.promised_bytes(HOST) == 0
            assert b.resize_cache(576 * KiB) == 576 * KiB       # 512 KiB unmapped: fits exactly
            assert memory.promised_bytes(HOST) == 1024 * KiB    # all of it, never more
    assert memory.promised_bytes(HOST) == 0                      # both closed: nothing promised


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_a_swap_space_promises_what_swap_outs_have_not_filled_and_nothing_once_closed(host, cache):
    """Swap-outs fill the swap space: what they allocated (the cache's host buffers) leaves
    the promise, what comes back returns to it; closed, it promises nothing."""
    host["available"] = 64 * 1024 * KiB
    a = _engine(cache, cache_bytes=64 * KiB, max_context=64, block_size=8, max_tokens_per_step=4,
                preemption="swap", swap_bytes=64 * KiB)
    try:
        for prompt in [[1, 2, 3]] * 4:
            a.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        filled = []
        while a.has_unfinished():
            a.step()
            swapped = a.kv.cache.swapped_bytes
            assert a.promised_bytes(HOST) == memory.promised_bytes(HOST) == 64 * KiB - swapped
            filled.append(swapped)
        assert max(filled) > 0 and a.stats().num_swap_preemptions > 0
        assert a.promised_bytes(HOST) == 64 * KiB                # all swapped back in: unfilled
    finally:
        a.close()
    assert a.promised_bytes(HOST) == memory.promised_bytes(HOST) == 0


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_a_swap_out_leaves_out_the_other_engines_promises_and_not_its_own(host, cache):
    """A swap-out's buffer is checked against what the host has less the other engines'
    promises (another's unfilled 512 KiB swap space refuses it, the step rolled back), not its
    own engine's: the bytes it fills were promised, and its unfilled rest is its own."""
    opts = dict(cache_bytes=64 * KiB, max_context=64, block_size=8, max_tokens_per_step=4,
                preemption="swap", swap_bytes=64 * KiB)
    batch, params = [[1, 2, 3]] * 4, SamplingParams(max_new_tokens=40, ignore_eos=True)
    host["available"] = 64 * 1024 * KiB
    with _engine(cache, **opts) as alone:
        reference = [out.outputs[0].token_ids for out in alone.generate(batch, params)]
        assert alone.stats().num_swap_preemptions > 0
    with _engine(cache, **opts) as a, _engine(cache_bytes=64 * KiB, **SWAP) as b:
        ids = [a.add_request(prompt, params) for prompt in batch]
        host["available"] = 512 * KiB + 8 * KiB        # b's swap space promised all but 8 KiB
        with pytest.raises(PlanExecutionError) as info:
            for _ in range(200):
                a.step()
        assert isinstance(info.value.__cause__, CacheTooLargeError)
        for words in ("swapping out sequence", "MemAvailable (532480 bytes) less the 524288 "
                      "bytes other KV pools in this process promised", "is 8192 bytes"):
            assert words in str(info.value), (words, str(info.value))
        assert a.kv.cache.swapped_bytes == 0 and a.stats().num_swap_preemptions == 0
        b.close()                     # its promise given back; a's own unfilled rest is no bar
        # a plan's swap-outs (at most 40 KiB) fit; less a's own unfilled rest (50 KiB at the
        # first, of 27 tokens) nothing would
        host["available"] = 48 * KiB
        a.run_until_done()
        a.run_until_done()
        assert [a.output(i).outputs[0].token_ids for i in ids] == reference
        assert a.stats().num_swap_preemptions > 0 and a.promised_bytes(HOST) == 64 * KiB
