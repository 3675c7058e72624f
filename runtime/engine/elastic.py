"""The engine's elastic KV memory: ``resize_cache``, ``sleep``/``wake``, ``reset_prefix_cache``
and a shared ``MemoryBudget`` (scheduler/budget.py), each one step transaction like a request's
ending (the scheduler's plan of unmaps, preemptions and ReleasePages, run by ``_execute``,
so every tensor-parallel rank applies it).

Only the vmem cache resizes (pages are mapped one by one); paged is refused by name. The pool's
page ids are reserved at construction for ``EngineConfig.max_cache_bytes``; growing past it is
refused. Growing is checked against the device's available memory first (a page's memory is
created when it is next mapped, so the memory a grow needs is the new size less the pool's
``committed_bytes``: the pages promised by earlier grows and not created yet count too), beside,
with the cache on the host, the swap space promised at construction that swapped-out sequences
have not filled yet (``unfilled_swap_bytes``): both are filled on demand, so a pool grown into
them would over-commit the host. With the cache on the host and spawned tensor-parallel ranks,
every rank's pool is in this machine's memory: each byte of a rank's size counts once per rank,
as at construction (``check_ranks_fit``). On CUDA rank 0 checks its own GPU only. What the other
engines in this process have promised and not created (``promised_bytes``, tracked in
runtime/memory.py: a grown pool's unmapped pages, a swap space's unfilled bytes) is not
available to this one: every check leaves it out.
"""
from __future__ import annotations

import weakref
from typing import Optional

from vmemkv.runtime import memory
from vmemkv.runtime.memory import bytes_from_fraction, check_fits_device, same_device
from vmemkv.runtime.interrupts import deferred_interrupts
from vmemkv.scheduler.errors import CacheResizeError
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.plan import StepPlan

from .budget_share import budget_share_for
from .config import cache_budget_bytes
from .errors import EngineClosedError, EngineSleepingError, TensorParallelError
from .tensor_parallel import check_ranks_fit


class ElasticMemory:
    """Mixed into Engine (its ``_txn``, ``scheduler``, ``kv``, ``config``)."""

    def _checked_cache_bytes(self, memory_budget) -> int:
        """The KV budget in bytes (``cache_budget_bytes``), checked before anything is built
        against the device's memory less the other engines' promises (beside one step's
        logits; every spawned rank's, swap spaces too) and ``memory_budget``'s rules. The
        construction holds ``PROMISES_LOCK`` from here until ``_init_elastic`` tracks it."""
        cfg, device = self.config, self.cache_config.torch_device
        cache_bytes = cache_budget_bytes(cfg, self.cache_config, self.vocab_size)   # + logits
        check_ranks_fit(cfg, cache_bytes, device)   # all ranks, too
        budget_share_for(memory_budget, cfg, cache_bytes, "", register=False, device=device)
        return cache_bytes

    def _init_elastic(self, budget_share) -> None:
        self.memory_share = budget_share      # a MemoryBudget share, or None
        if budget_share is not None:   # registered at cache_bytes; the pool: whole page groups
            budget_share.built(self.kv.manager.cache_bytes)
        # an engine dropped without close() leaves the budget at the budget's next call after
        # it is collected (the finalizer holds the share, not the engine, and may run inside
        # another engine's budget call: it only queues); close() leaves at once
        self._budget_finalizer = (weakref.finalize(self, budget_share.unregister_later)
                                  if budget_share is not None else None)
        self._asleep_bytes: Optional[int] = None   # the size to wake to; None: awake
        self._preempted_last = 0                   # scheduler preemptions seen at the last step
        self.resizes = 0
        # its pool's pages past committed_bytes and its unfilled swap space are promised: every
        # engine is tracked (weakly); a swap-out leaves this engine's promises out of its check
        memory.track_promises(self)
        self.kv.cache.swap_promised_by(self)

    def promised_bytes(self, device) -> int:
        """Bytes of ``device`` memory this engine may fill on demand and has not created yet
        (runtime/memory.py's ``PromisesMemory``): on the cache's device, a resizable pool's
        ``cache_bytes`` less ``committed_bytes`` (nothing asleep), once per rank spawned on the
        host; on the host, also the swap space swap-outs have not filled yet
        (``_host_swap_unfilled_bytes``, wherever the cache is); 0 once closed."""
        if self._closed:
            return 0
        promised = 0
        if self.resizable and same_device(device, self.cache_config.torch_device):
            promised += self._pool_copies() * max(0, self.cache_bytes - self.committed_bytes)
        if same_device(device, "cpu"):
            promised += self._host_swap_unfilled_bytes()
        return promised

    def _leave_budget(self) -> None:
        """Leave the budget and stop counting the engine's promises now (close, a construction
        that failed). Idempotent."""
        memory.forget_promises(self)
        if self._budget_finalizer is not None:
            self._budget_finalizer.detach()
            self.memory_share.unregister()

    @property
    def cache_bytes(self) -> int:
        """Bytes of device memory the KV pool may use now."""
        return self.kv.manager.cache_bytes

    @property
    def is_sleeping(self) -> bool:
        return self._asleep_bytes is not None

    def resize_cache(self, cache_bytes: Optional[int] = None, *,
                     memory_utilization: Optional[float] = None, preempt: bool = False) -> int:
        """Let the KV pool use ``cache_bytes`` (or ``memory_utilization``: that fraction of
        the device's available memory less ``unfilled_swap_bytes``, plus the pool's
        ``committed_bytes``, so the same call again changes nothing; per rank, as at
        construction: with spawned tensor-parallel ranks on the host, a fraction above
        1 / ``tensor_parallel_size`` is refused); returns the bytes it uses
        after (rounded down to whole page groups, the pool's resize step). Growing creates pages
        as they are mapped; shrinking gives back free and cached pages, then, with ``preempt``,
        preempts running requests
        from the newest (swapped or recomputed as ``preemption`` says: none is dropped).
        CacheResizeError, nothing changed, when it cannot: bytes running requests hold
        (without ``preempt``), a waiting request that would no longer fit, past
        ``max_cache_bytes``, the budget's share, or the device's available memory (what the
        grow needs beyond ``committed_bytes``, once per rank spawned on the host, beside the
        unfilled swap space);
        EngineSleepingError while asleep (``wake`` first)."""
        self._check_resizable()
        self._check_awake()
        if not isinstance(preempt, bool):
            raise CacheResizeError(f"preempt must be True or False, got {preempt!r}")
        if (cache_bytes is None) == (memory_utilization is None):
            raise CacheResizeError("resize_cache takes one of cache_bytes and "
                                   "memory_utilization")
        if memory_utilization is not None:
            cache_bytes = self._bytes_for_utilization(memory_utilization)
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise CacheResizeError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        if self.memory_share is not None:
            granted = self.memory_share.grant(cache_bytes)   # reserved until _resize settles
            if granted < cache_bytes:
                self.memory_share.settle(self.cache_bytes)      # gives the reservation back
                raise CacheResizeError(
                    f"resize_cache({cache_bytes}): the memory budget grants this engine "
                    f"{granted} bytes (its max_bytes {self.memory_share.max_bytes}, what the "
                    f"other engines leave)")
        return self._resize(cache_bytes, preempt)

    def _resize(self, cache_bytes: int, preempt: bool, partial: bool = False,
                check_fit: bool = True) -> int:
        try:
            return self._resize_pool(cache_bytes, preempt, partial, check_fit)
        finally:        # done, refused or failed: what decide/grant reserved is settled
            if self.memory_share is not None:
                self.memory_share.settle(self.kv.manager.cache_bytes)

    def _resize_pool(self, cache_bytes: int, preempt: bool, partial: bool,
                     check_fit: bool) -> int:
        mgr = self.kv.manager
        # whole page groups (resize steps), as the pool counts them (max_cache_bytes was refused)
        whole = cache_bytes - cache_bytes % mgr.resize_step_bytes
        if whole > mgr.max_cache_bytes:
            raise CacheResizeError(f"cache_bytes={cache_bytes} ({whole} in whole page groups) "
                                   f"exceeds max_cache_bytes={mgr.max_cache_bytes} (EngineConfig."
                                   f"max_cache_bytes in whole page groups: the pool's page ids are "
                                   f"reserved at construction)")
        growth = cache_bytes - mgr.cache_bytes
        try:   # no other engine's check runs between this one's and the size it promises
            with memory.PROMISES_LOCK:
                if growth > 0:
                    self._check_growth_fits(growth, cache_bytes)
                with deferred_interrupts():   # a Ctrl-C lands after the counts agree
                    self._txn.run(lambda: self.scheduler.resize(cache_bytes, preempt,
                                                                check_fit, partial))
                    self.resizes += 1
                    # its preemptions (sleep, resize_cache(preempt=True), a yield): no step's
                    self._preempted_last = self.scheduler.metrics.num_preemptions
        except TensorParallelError as error:   # a rank died or hung, as in step: requests
            self.abandon(error)                # fail (run rolled back: abandon's finds nothing)
            raise
        return mgr.cache_bytes

    def _check_growth_fits(self, growth: int, cache_bytes: int) -> None:
        """CacheResizeError, before anything changes, when the memory growing each rank's pool
        to ``cache_bytes`` needs (``cache_bytes`` less its ``committed_bytes``, once per rank
        whose pool is in this device's memory) beside ``unfilled_swap_bytes`` exceeds the
        device's total memory, or its available memory less what the other engines' pools
        promised and have not created."""
        ranks, swap = self._pool_copies(), self.unfilled_swap_bytes   # swap: every rank's
        committed = self.committed_bytes
        unbacked = max(0, cache_bytes - committed)     # earlier grows' pages not created yet too
        what = f"growing the KV cache by {growth} bytes"
        if ranks > 1:
            what += f" on each of {ranks} tensor-parallel ranks spawned on this host"
        what += (f" (to {cache_bytes} bytes a rank, {unbacked} of them beyond the "
                 f"{committed} bytes whose pages exist: created when first mapped)")
        if swap:
            what += (f" beside the {swap} bytes of swap space (swap_bytes) swapped-out "
                     f"sequences have not filled yet")
        try:
            check_fits_device(what, ranks * unbacked + swap, self.cache_config.torch_device,
                              remedy="grow less" + (", or build the engine with less swap_bytes"
                                                    if swap else ""), promiser=self)
        except Exception as error:
            raise CacheResizeError(str(error)) from None

    def _bytes_for_utilization(self, fraction: float) -> int:
        """``resize_cache(memory_utilization=fraction)``'s size a rank: that fraction of the
        available memory (less the other engines' promises) less ``unfilled_swap_bytes``, plus
        ``committed_bytes`` (what the pool has created; a size promised beyond it is not in the
        available memory yet)."""
        grant = max(0, bytes_from_fraction(fraction, self.device, promiser=self)
                    - int(fraction * self.unfilled_swap_bytes))
        ranks = self._pool_copies()
        if ranks * fraction > 1:
            raise CacheResizeError(
                f"memory_utilization={fraction} is per rank, as at construction: "
                f"{ranks} tensor-parallel ranks spawned on this host would take "
                f"{ranks * fraction:.2f} of its available memory ({ranks} x {grant} bytes); "
                f"give at most 1/{ranks}")
        return grant + self.committed_bytes

    @property
    def committed_bytes(self) -> int:
        """Bytes of the pool (rank 0's; every rank's maps the same pages) whose memory exists
        now. vmem: pages are created when first mapped, so ``cache_bytes`` past it is promised;
        paged: the block pool is one tensor made whole at construction, and this is its bytes
        (a resident LoRA adapter's bytes are a buffer beside it)."""
        cache = self.kv.cache
        if cache.kind is CacheKind.PAGED:
            return cache.pools.nbytes
        return cache.pool.committed_bytes

    def _pool_copies(self) -> int:
        """Pools in this device's memory: ``tensor_parallel_size`` with the cache on the host
        and spawned ranks (they share this machine), else 1 (on CUDA each rank has its own
        GPU, and rank 0 reads only its own)."""
        if self.cache_config.torch_device.type != "cpu" or self.config.tp_launch != "spawn":
            return 1
        return self.config.tensor_parallel_size

    @property
    def unfilled_swap_bytes(self) -> int:
        """The swap space swap-outs have not filled yet (``_host_swap_unfilled_bytes``), beside
        which the pool grows: 0 when the cache is not on the host (the pool grows in device
        memory, the swap space is host memory)."""
        if self.cache_config.torch_device.type != "cpu":
            return 0
        return self._host_swap_unfilled_bytes()

    def _host_swap_unfilled_bytes(self) -> int:
        """Host memory promised to the swap space (``swap_bytes``, checked at construction) that
        swapped-out sequences have not filled yet (each swap-out allocates its buffer), once per
        tensor-parallel rank spawned on this machine (each holds its own, wherever its cache
        is); 0 without swap space."""
        copies = self.config.tensor_parallel_size if self.config.tp_launch == "spawn" else 1
        return copies * self.kv.manager.swap_free_bytes

    def _pool_room_bytes(self) -> Optional[int]:
        """The most a rank's pool may grow to now (None: the available memory is unreadable):
        ``committed_bytes`` plus its share of the available memory less the other engines'
        promises and ``unfilled_swap_bytes``."""
        avail = memory.unpromised_available_bytes(self.cache_config.torch_device, self)
        if avail is None:
            return None
        room = max(0, avail - self.unfilled_swap_bytes) // self._pool_copies()
        return self.committed_bytes + room

    def reset_prefix_cache(self) -> int:
        """Evict every prefix-cache entry no live request holds (vLLM's ``reset_prefix_cache``):
        later prompts compute those tokens again (a benchmark's cold start); what live requests
        hold stays theirs, and stays findable. One transaction, as a resize is (every
        tensor-parallel rank applies it). Returns the cached tokens evicted (the
        ``prefix_cache_cached_tokens`` gauge before; 0 without prefix sharing or asleep)."""
        if self._closed:
            raise EngineClosedError("reset_prefix_cache after close(): the cache is released")
        mgr = self.kv.manager
        evicted = mgr.cached_tokens

        def evict() -> StepPlan:
            mgr.reset_prefix_cache()
            return StepPlan([], mgr.take_ops())
        try:
            self._txn.run(evict)
        except TensorParallelError as error:   # a rank died or hung: as in a resize
            self.abandon(error)
            raise
        return evicted

    def sleep(self) -> int:
        """Give every physical KV page back to the device: running requests are preempted
        (swapped to host memory or recomputed later, as ``preemption`` says), the prefix
        cache is dropped; virtual ranges, queues and requests stay. Until ``wake()``,
        ``step()`` runs nothing and ``generate`` raises EngineSleepingError; requests may still
        be added (they wait). Returns the bytes given back. Idempotent."""
        self._check_resizable()
        if self.is_sleeping:
            return 0
        before = self.cache_bytes
        if self.memory_share is not None:
            self.memory_share.withdraw()      # asleep, it asks nobody to yield to it
        with deferred_interrupts():   # a Ctrl-C lands once asleep is recorded
            self._resize(0, preempt=True, check_fit=False)
            self._asleep_bytes = before
        return before

    def wake(self) -> int:
        """Take back the memory ``sleep`` gave (with a budget: what it grants, at least this
        engine's minimum) and serve again; returns the cache bytes. Idempotent."""
        if self._closed:
            raise EngineClosedError("the engine is closed; its cache is released")
        if not self.is_sleeping:
            return self.cache_bytes
        target = self._asleep_bytes
        if self.memory_share is not None:
            target = self.memory_share.grant(target)
        with deferred_interrupts():   # a Ctrl-C lands once awake is recorded
            self._resize(target, preempt=False, check_fit=False)
            self._asleep_bytes = None
        return self.cache_bytes

    @property
    def resizable(self) -> bool:
        """Whether this engine's cache can be resized, put to sleep and woken (vmem: pages mapped
        one by one; a paged block pool is one tensor); fixed at construction."""
        return self.config.cache == "vmem"

    def _check_resizable(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; its cache is released")
        if not self.resizable:
            raise CacheResizeError(f"resizing needs cache='vmem' (pages mapped one by one); "
                                   f"this engine's cache is {self.config.cache!r}, whose block "
                                   f"pool is one tensor")

    def _check_awake(self) -> None:
        if self._closed:   # closed asleep: "call wake() first", and wake() refused the close
            raise EngineClosedError("the engine is closed; its cache is released")
        if self.is_sleeping:
            raise EngineSleepingError("the engine is asleep (sleep()): call wake() first")

    def rebalance_memory(self) -> None:
        """With a MemoryBudget (``step`` calls it first; an idle engine's owner calls it now and
        then so its pages go back): grow for a waiting request that does not fit, give back
        what nobody running holds when asked or idle, yield to an older blocked engine, with
        preemption if need be (``BudgetShare.decide``). A shrink that would refuse a waiting
        request is skipped."""
        share = self.memory_share
        if share is None or self.is_sleeping:
            return
        preemptions = self.scheduler.metrics.num_preemptions
        preempted, self._preempted_last = preemptions > self._preempted_last, preemptions
        target = share.decide(self.scheduler, preempted=preempted)
        if target is None or target == self.cache_bytes:
            share.settle(self.cache_bytes)         # nothing reserved stays reserved
            return
        target = min(target, self.kv.manager.max_cache_bytes)
        if target > self.cache_bytes:
            room = self._pool_room_bytes()   # per rank, less the swap and pages not created
            if room is not None and room <= self.cache_bytes:
                share.settle(self.cache_bytes)      # no room to grow: nothing stays reserved
                return
            if room is not None:
                target = min(target, room)
        try:          # a yield to an older blocked engine may preempt (share.preempts)
            self._resize(target, preempt=share.preempts, partial=True)
        except CacheResizeError:
            pass       # a waiting request would no longer fit: keep the pages (rolled back)
