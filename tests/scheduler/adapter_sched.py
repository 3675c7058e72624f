"""What the adapter scheduler tests share (issue 31): the tiny model's managers, adapter refs
by name and key, a random driver, and the pin invariant checked after every call."""
import collections
import hashlib
import random

from vmemkv.scheduler.adapters import AdapterRef
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.presets import get_model

TINY = get_model("tiny")       # 4,096 bytes per token
PAGE = 4096
POLICIES = [("paged", "per-layer"), ("vmem", "per-layer"), ("vmem", "interleaved")]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def ref(name: str, key: str, num_bytes: int) -> AdapterRef:
    return AdapterRef(name, digest(key), num_bytes)


def manager(policy, layout="per-layer", tokens=128, swap_tokens=0, **options):
    return make_manager(policy, TINY, tokens * TINY.bytes_per_token, 64, block_size_tokens=4,
                        page_bytes=PAGE, layout=layout,
                        swap_bytes=swap_tokens * TINY.bytes_per_token, **options)


def unit_bytes(mgr) -> int:
    return mgr.page_bytes if mgr.name == "vmem" else mgr.block_bytes


def run(sched, max_steps=5000, rng=None):
    rng = rng or random.Random(0)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        plan = sched.schedule()
        check_pins(sched)
        sampled = {s.seq_id: rng.randrange(1, 10) for s in plan.seqs if s.sample}
        for s in plan.seqs:
            sampled.update({c: rng.randrange(1, 10) for c in s.fork_ids})
        sched.update(sampled)
        check_pins(sched)
    raise AssertionError(f"not finished after {max_steps} steps")


def check_pins(sched):
    """Each adapter's uses are its running sequences, exactly."""
    mgr, running = sched.manager, collections.Counter()
    for seq in sched.running:
        if seq.request.adapter is not None:
            running[seq.request.adapter.digest] += 1
    refs = {s.request.adapter.digest: s.request.adapter for s in sched.seqs.values()
            if s.request.adapter is not None}
    for d, r in refs.items():
        assert mgr.adapter_uses(r) == running[d], (r, mgr.adapter_uses(r), running[d])
    assert set(running) <= set(mgr.resident_adapters())
    assert mgr.adapter_stats().pinned == len(running)
