"""What a budget share reads of its scheduler (scheduler/budget.py's rule, per step): the bytes
its head request lacks, what no running sequence holds, what the running ones will grow into.
All in bytes of the scheduler's manager (its ``bytes_per_token``): a vmem one, the only pool
that resizes (the engine and the simulator refuse a budget for any other)."""
from __future__ import annotations

from .errors import ConfigError


def check_resizes(manager) -> None:
    """ConfigError naming the policy of a ``manager`` whose pool cannot resize (a share's
    decisions would be sizes nothing can apply)."""
    if not manager.resize_step_bytes:
        raise ConfigError(f"a MemoryBudget share needs a pool that resizes at run time (policy "
                          f"'vmem'), got policy {manager.name!r}")


def wanted_bytes(scheduler, held_bytes: int, grow_step_bytes: int, preempted: bool) -> int:
    """What the head waiting request needs beside ``held_bytes``: its tokens with room to
    decode up to ``grow_step_bytes`` (not preempted at its next token), its adapter's bytes
    when that is not resident; one byte more after a preemption, with only swapped sequences,
    or a beam group that fits alone but not as a group (one grow step); else ``held_bytes``."""
    mgr = scheduler.manager
    if scheduler.swapped and not scheduler.running:     # it swaps in whole, then decodes
        head = scheduler.swapped[0]
        return held_bytes + _lacked_bytes(scheduler, head, head.length, grow_step_bytes)
    if preempted:
        return held_bytes + 1
    if scheduler.waiting and len(scheduler.running) < scheduler.config.max_running:
        head = scheduler.waiting[0]
        adapter = head.request.adapter      # its pages come from the same pool
        with_adapter = {} if adapter is None else {"adapter": adapter}
        admitted = scheduler._admit_tokens(head)   # a recomputed windowed one: its prompt
        if not mgr.can_allocate(admitted, None, None, 0,
                                final_tokens=head.request.max_total_len, **with_adapter):
            missing = _lacked_bytes(scheduler, head, admitted, grow_step_bytes)
            if adapter is not None and adapter.digest not in mgr.resident_adapters():
                missing += adapter.num_bytes
            return held_bytes + missing
    if scheduler.starved:
        return held_bytes + 1
    return held_bytes


def _lacked_bytes(scheduler, head, tokens: int, grow_step_bytes: int) -> int:
    """What ``head`` lacks beside the unused bytes: its ``tokens`` (what admission or a swap-in
    allocates it) and room to decode, up to one grow step (at least one byte: the pool's next
    resize step)."""
    mgr = scheduler.manager
    decode = min(head.request.max_total_len - head.length, grow_step_bytes // mgr.bytes_per_token)
    return max(tokens + max(0, decode) - unused_bytes(scheduler) // mgr.bytes_per_token,
               1) * mgr.bytes_per_token


def unused_bytes(scheduler) -> int:
    """Bytes of the cache no running sequence holds (free, unused and cached pages)."""
    mgr = scheduler.manager
    return (mgr.stats().free_tokens + mgr.reclaimable_tokens) * mgr.bytes_per_token


def growth_bytes(scheduler) -> int:
    """What the running sequences may still grow by (to their requests' max lengths, in whole
    pages: a sequence holds its last page's tokens already)."""
    mgr = scheduler.manager
    tpp = mgr.tokens_per_page
    pages = sum(max(0, -(-q.request.max_total_len // tpp) - -(-mgr.num_tokens(q.seq_id) // tpp))
                for q in scheduler.running)
    return pages * tpp * mgr.bytes_per_token
