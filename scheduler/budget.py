"""MemoryBudget: one device's KV memory shared by several engines (or simulated models) that
draw pages from it at run time. Pure Python: the engine and the simulator run the same rule.

    budget = MemoryBudget(total_bytes=8 * 2**30, idle_release_s=2.0)
    a = budget.register("llama", min_bytes=2 * 2**30, max_bytes=6 * 2**30, initial_bytes=4 * 2**30)
    target = a.decide(scheduler, now)       # before a step: the cache size this share wants
    ...resize the cache to target (Scheduler.resize, partial, preempt=a.preempts), then:
    a.settle(new_bytes)                     # always, even when the resize failed or was skipped

Each share holds ``held_bytes`` (what its cache may use). Guarantees: the shares' held bytes,
with what ``decide``/``grant`` reserved for a resize under way (under the lock, the unused part
given back at ``settle``: two engine threads cannot take the same bytes), never exceed
``total_bytes``; a share's ``min_bytes`` is reserved for it (no other share can take it, even
while it is below it or asleep); a share never holds more than ``max_bytes``. Once per step:

    grow     the scheduler's head waiting request does not fit, with its LoRA adapter's pages
             when that is not resident (or the last step preempted, or admitted nothing into an
             idle pool: a beam group that must come back into private memory): its NEED is
             what the head lacks (its tokens, room to decode up to one grow step, adapter);
             take at least ``grow_fraction`` of max from the unclaimed bytes older BLOCKED
             shares do not wait for (below); what is missing is posted as PRESSURE on the
             other shares, the most spare first, then by name (withdrawn when it no longer asks)
    yield    another share is BLOCKED and older (below): give it the need it still misses, down to
             ``min_bytes``, free and cached pages first, then preempting this share's running
             sequences from the newest (``preempts``: recompute or swap, as its preemption
             setting says), even while this share has requests of its own waiting
    give     idle (nothing unfinished) for ``idle_release_s``: shrink to ``min_bytes`` (free
             and cached pages; the caller resizes with ``partial``: no preemption); or
             pressure posted on this share while it needs nothing (no request waiting,
             swapped or just preempted): give what its running sequences will not grow into
             (to their max lengths), keeping at least one grow step

Liveness, one rule (first come, first served across the shares): a share is BLOCKED when it
asks to grow and has nothing running (its head request, a sequence preempted back to the queue,
a swapped one or a beam group cannot run before it grows: no step of its own frees memory). The
first time a blocked share's head sequence is seen blocked, the budget stamps it from one
counter for all shares; a share's AGE is its oldest stamp among its unfinished sequences
(running ones included: a sequence keeps its stamp through its preemptions), none: youngest of
all. Every share younger than a blocked one yields to it; bytes unclaimed go to the oldest
blocked share first. So the oldest stamped sequence always progresses, stamps only grow, and
every accepted request eventually runs (accepted: it fits the most its pool has held, which the
others' minimums leave room for; a share registered later whose minimum takes that room can
still starve it). A share with something running never becomes blocked (its own steps free
memory): a busy neighbour is preempted only for the need of a share that cannot run at all, and
a share whose stamped sequences ended (aborted) holds nobody back even before it decides again.
Explicit ``grant``s (resize_cache, wake) take what is unclaimed, outside this order. No rule
reads the order the shares registered in (ties go by name; names are unique). One lock guards
the counts: ``decide``, ``grant``, ``settle`` may run on each engine's thread. A collected
engine's share leaves (``unregister_later``) as the next call takes the lock, never inside a call.
"""
from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, Optional

from .budget_checks import check_budget, check_share
from .budget_needs import check_resizes, growth_bytes, unused_bytes, wanted_bytes
from .errors import ConfigError


@dataclass
class ShareStats:
    """One share's counters (bytes; grows and gives are resize events)."""
    name: str
    held_bytes: int
    min_bytes: int
    max_bytes: int
    pressure_bytes: int
    grows: int = 0
    gives: int = 0
    grown_bytes: int = 0
    given_bytes: int = 0
    yields: int = 0                # decisions to give to an older blocked share


class BudgetShare:
    """One engine's (or simulated model's) part of a MemoryBudget."""

    def __init__(self, budget: "MemoryBudget", name: str, min_bytes: int, max_bytes: int,
                 held_bytes: int) -> None:
        self.budget, self.name = budget, name
        self.min_bytes, self.max_bytes, self.held_bytes = min_bytes, max_bytes, held_bytes
        self.reserved_bytes = 0            # granted by decide/grant, not settled yet
        self.pressure_by: Dict[str, int] = {}   # asking share's name -> bytes it waits for
        self.idle_since: Optional[float] = None
        self.stamps: Dict[int, int] = {}   # seq id -> when the budget first saw it blocked
        self._seqs: Dict[int, object] = {}  # its scheduler's sequences (at its last decide)
        self.age = math.inf                # its oldest stamp among unfinished sequences
        self.blocked, self.ask_bytes = False, 0   # asks to grow with nothing running; its need
        self.preempts = False              # the last decision may preempt (a yield)
        self.stats = ShareStats(name, held_bytes, min_bytes, max_bytes, 0)

    @property
    def pressure_bytes(self) -> int:
        """Bytes other shares wait for from this one (the largest ask posted on it)."""
        return max(self.pressure_by.values(), default=0)

    @property
    def reachable_bytes(self) -> int:
        """The most this share can hold now: its max, less than the total by the other shares'
        minimums (reserved for them even while they hold less)."""
        with self.budget._locked():
            others = sum(s.min_bytes for s in self.budget._shares.values() if s is not self)
        return max(0, min(self.max_bytes, self.budget.total_bytes - others))

    @property
    def _claim(self) -> int:
        """What the others cannot take: held and reserved bytes, at least the minimum."""
        return max(self.min_bytes, self.held_bytes + self.reserved_bytes)

    # -- the rule, before a step --
    def decide(self, scheduler, now: Optional[float] = None, preempted: bool = False) -> Optional[int]:
        """The cache size (bytes) this share wants before its next step, None for no change.
        ``preempted``: the last step preempted (running sequences are short of memory). A grow
        is reserved until ``settle``; ``preempts`` says whether the resize may preempt."""
        check_resizes(scheduler.manager)                  # before any state changes
        b, now = self.budget, (self.budget.clock() if now is None else now)
        with b._locked():
            self.reserved_bytes, self.preempts = 0, False
            if scheduler.has_unfinished():
                self.idle_since = None
            elif self.idle_since is None:
                self.idle_since = now
            want = wanted_bytes(scheduler, self.held_bytes,
                                int(b.grow_fraction * self.max_bytes), preempted)
            asking = want > self.held_bytes and self.held_bytes < self.max_bytes
            blocked_now = asking and not scheduler.running
            self._stamp(scheduler, blocked_now)
            yielded = self._yield_target()
            if yielded is not None:
                return yielded
            if blocked_now or (asking and not self.blocked):
                return self._grow(scheduler, want)
            if self.blocked:       # still owed its last ask: takes what is free of it
                return self._take(min(self.ask_bytes, self.max_bytes - self.held_bytes))
            if not asking:         # what it posted when it asked is no longer wanted
                b._withdraw_pressure(self)
            idle = self.idle_since is not None and now - self.idle_since >= b.idle_release_s
            if self.held_bytes <= self.min_bytes:
                return None
            if idle:
                return self.min_bytes
            needy = preempted or scheduler.waiting or scheduler.swapped
            if self.pressure_bytes and not needy:
                # only what nobody uses nor will: giving what the running ones grow into
                # preempts them (thrash); at least a grow step of headroom stays
                give = min(self.pressure_bytes, unused_bytes(scheduler)
                           - max(int(b.grow_fraction * self.max_bytes), growth_bytes(scheduler)))
                if give > 0:
                    return max(self.min_bytes, self.held_bytes - give)
            return None

    def _stamp(self, scheduler, blocked: bool) -> None:
        """Stamps the blocked head sequence (first time only), forgets ended ones, sets
        ``age`` and ``blocked`` (the module docstring's liveness rule). A share stays blocked
        until it got what it asked or its stamped sequences ended, though it runs meanwhile (a
        sequence swapped in, then out again for want of its last pages, must not lose the
        pages yielded to it in between)."""
        seqs = self._seqs = scheduler.seqs
        for seq_id in [i for i in self.stamps if i not in seqs or seqs[i].state.is_ended]:
            del self.stamps[seq_id]
        self.blocked = blocked or (self.blocked and self.ask_bytes > 0 and bool(self.stamps))
        if not self.blocked:
            self.ask_bytes = 0
        elif blocked:
            head = scheduler.swapped[0] if scheduler.swapped else \
                scheduler.waiting[0] if scheduler.waiting else None
            if head is not None and head.seq_id not in self.stamps:
                self.stamps[head.seq_id] = next(self.budget._stamps)
        self.age = min(self.stamps.values(), default=math.inf)

    def _blocked_age(self) -> float:
        """Its age while blocked for a sequence that has not ended, else inf (what the others
        read: an engine whose request was aborted is not stepped again to decide)."""
        if not self.blocked:
            return math.inf
        seqs = self._seqs
        return min((stamp for seq_id, stamp in self.stamps.items()
                    if (seq := seqs.get(seq_id)) is not None and not seq.state.is_ended),
                   default=math.inf)

    def _yield_target(self) -> Optional[int]:
        """The smaller size that gives the oldest blocked share older than this one what it
        still misses (down to ``min_bytes``, preempting if need be); None: nobody to yield to."""
        if self.held_bytes <= self.min_bytes:
            return None
        b = self.budget
        ages = {s: s._blocked_age() for s in b._shares.values() if s is not self}
        for older in sorted((s for s, age in ages.items() if age < self.age), key=ages.get):
            need = older.ask_bytes - older.reserved_bytes - max(0, b._free_for(older))
            if need > 0:
                self.preempts = True
                self.stats.yields += 1
                return max(self.min_bytes, self.held_bytes - need)
        return None

    def _grow(self, scheduler, want: int) -> Optional[int]:
        b = self.budget
        need = min(want, self.max_bytes) - self.held_bytes
        grant = max(need, min(self.max_bytes - self.held_bytes,
                              int(b.grow_fraction * self.max_bytes)))
        # a grant the pool would round down to nothing never grows it (a step of
        # the budget below one of the pool's, a group of several pages)
        step = scheduler.manager.resize_step_bytes
        if step:
            need, grant = (min(-(-(self.held_bytes + n) // step) * step, self.max_bytes)
                           - self.held_bytes for n in (need, grant))
        # the others yield only what it cannot run without: the grow step beyond it is
        # taken when free, never preempted for (a share running on the bytes yielded to it
        # would stay blocked for the rest, and its neighbours preempted for it, step after step)
        self.ask_bytes = need if self.blocked else 0
        return self._take(grant)

    def _take(self, grant: int) -> Optional[int]:
        """Reserve what is free of ``grant`` bytes, the rest posted as pressure; the size."""
        b = self.budget
        free = b._free_for(self)
        if grant > free:
            b._post_pressure(self, grant - free)
        if free <= 0 or grant <= 0:
            return None
        self.reserved_bytes = min(grant, free)
        return self.held_bytes + self.reserved_bytes

    def settle(self, new_bytes: int) -> None:
        """The cache now uses ``new_bytes`` (after the resize ``decide`` or ``grant`` asked
        for, done in whole, in part or not at all): the difference goes to or comes from the
        budget and what was reserved and not used goes back. A share unregistered meanwhile
        (its engine closed) settles nothing."""
        b = self.budget
        with b._locked():
            if b._shares.get(self.name) is not self:
                self.reserved_bytes = 0
                return
            delta = new_bytes - self.held_bytes
            if delta > self.reserved_bytes + b._unclaimed_for(self):
                raise ConfigError(f"share {self.name!r}: settling {new_bytes} bytes takes "
                                  f"{delta} more than the budget has unclaimed")
            self.held_bytes, self.reserved_bytes = new_bytes, 0
            self.stats.held_bytes = new_bytes
            if delta > 0:
                self.stats.grows += 1
                self.stats.grown_bytes += delta
                self.ask_bytes = max(0, self.ask_bytes - delta)
            elif delta < 0:
                self.stats.gives += 1
                self.stats.given_bytes -= delta
                self.pressure_by = {k: v + delta for k, v in self.pressure_by.items()
                                    if v + delta > 0}
            self.stats.pressure_bytes = self.pressure_bytes

    def grant(self, new_bytes: int) -> int:
        """An explicit resize's part (``Engine.resize_cache``, ``wake``): the most of
        ``new_bytes`` the budget allows this share now (its max, what the others leave
        unclaimed), reserved until ``settle`` (call it after the resize, done or not)."""
        with self.budget._locked():
            self.reserved_bytes = 0
            granted = min(new_bytes, self.max_bytes,
                          self.held_bytes + max(0, self.budget._unclaimed_for(self)))
            self.reserved_bytes = max(0, granted - self.held_bytes)
            return granted

    def withdraw(self) -> None:
        """Stop asking (an engine asleep), its pressure withdrawn: none yields to it till asked."""
        with self.budget._locked():
            self.blocked, self.ask_bytes = False, 0
            self.budget._withdraw_pressure(self)

    def built(self, cache_bytes: int) -> None:
        """Its cache holds ``cache_bytes`` (whole page groups): no more held, nor as its minimum."""
        with self.budget._locked():   # no give counted; a minimum above it claimed unheld bytes
            self.held_bytes = self.stats.held_bytes = min(self.held_bytes, cache_bytes)
            self.min_bytes = self.stats.min_bytes = min(self.min_bytes, self.held_bytes)

    def unregister(self) -> None:
        """Give everything back and leave the budget (an engine closed or collected); the
        pressure it posted on the others goes with it. Idempotent."""
        b = self.budget
        with b._locked():
            if b._shares.get(self.name) is self:
                del b._shares[self.name]
            self.held_bytes = self.reserved_bytes = self.ask_bytes = 0
            self.blocked = False
            b._withdraw_pressure(self)

    def unregister_later(self) -> None:
        """``unregister`` at the budget's next call (a GC finalizer's: it runs wherever the GC
        does, maybe inside a budget call on this thread, which re-enters the lock, reading the
        shares): changes nothing now and takes no lock (its holder may wait on this thread)."""
        self.budget._leaving.append(self)


class MemoryBudget:
    """``total_bytes`` of one device's memory for the shares ``register`` creates."""

    def __init__(self, total_bytes: int, idle_release_s: float = 2.0,
                 grow_fraction: float = 0.125, clock: Callable[[], float] = time.monotonic) -> None:
        check_budget(total_bytes, idle_release_s, grow_fraction, clock)   # by name
        self.total_bytes, self.idle_release_s = total_bytes, idle_release_s
        self.grow_fraction, self.clock = grow_fraction, clock
        self._lock = threading.RLock()  # taken through _locked() only
        self._shares: Dict[str, BudgetShare] = {}
        self._leaving: Deque[BudgetShare] = deque()   # unregister_later's, for the next call
        self._lock_depth = 0                           # its holder's nested acquisitions
        self._stamps = itertools.count(1)              # the blocked sequences' stamps

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock. Taken from outside (not re-entered), it first unregisters the shares
        ``unregister_later`` queued: nobody holding the lock sees the shares change under it."""
        with self._lock:
            self._lock_depth += 1
            try:
                while self._lock_depth == 1 and self._leaving:
                    self._leaving.popleft().unregister()
                yield
            finally:
                self._lock_depth -= 1

    def register(self, name: str, min_bytes: int, max_bytes: int,
                 initial_bytes: Optional[int] = None) -> BudgetShare:
        """A new share holding ``initial_bytes`` (default ``min_bytes``); ConfigError when the
        name is taken or not a non-empty str, min > max, or the budget cannot hold it beside
        the others' minimums (budget_checks.py names the field)."""
        initial = min_bytes if initial_bytes is None else initial_bytes
        check_share(name, min_bytes, max_bytes, initial)
        with self._locked():
            if name in self._shares:
                raise ConfigError(f"a share named {name!r} is already registered")
            reserved = sum(s._claim for s in self._shares.values())
            if reserved + initial > self.total_bytes:
                raise ConfigError(
                    f"share {name!r}: {initial} bytes do not fit the budget of "
                    f"{self.total_bytes} bytes beside the {reserved} the other shares hold or "
                    f"reserve")
            share = self._shares[name] = BudgetShare(self, name, min_bytes, max_bytes, initial)
            return share

    def _unclaimed_for(self, share: BudgetShare) -> int:
        """Bytes ``share`` may take: the total less what the others hold, reserve for a resize
        under way or keep as their minimums, and what it holds and reserved."""
        others = sum(s._claim for s in self._shares.values() if s is not share)
        return self.total_bytes - others - share.held_bytes - share.reserved_bytes

    def _free_for(self, share: BudgetShare) -> int:
        """What ``share`` may grow into now: the unclaimed bytes less what the blocked shares
        older than it still miss (first come, first served)."""
        waited = sum(max(0, s.ask_bytes - s.reserved_bytes) for s in self._shares.values()
                     if s is not share and s._blocked_age() < share.age)
        return self._unclaimed_for(share) - waited

    def _withdraw_pressure(self, asking: BudgetShare) -> None:
        for share in (s for s in self._shares.values() if asking.name in s.pressure_by):
            del share.pressure_by[asking.name]
            share.stats.pressure_bytes = share.pressure_bytes

    def _post_pressure(self, asking: BudgetShare, missing_bytes: int) -> None:
        """Ask the others above their minimum for ``missing_bytes`` in all: most spare first,
        equally spare ones by name (never by registration order)."""
        left = missing_bytes
        for share in sorted(self._shares.values(),
                            key=lambda s: (s.min_bytes - s.held_bytes, s.name)):
            if share is asking or left <= 0:
                continue
            spare = share.held_bytes - share.min_bytes
            if spare > 0:
                share.pressure_by[asking.name] = max(share.pressure_by.get(asking.name, 0),
                                                     min(spare, left))
                share.stats.pressure_bytes = share.pressure_bytes
                left -= min(spare, left)

    @property
    def held_bytes(self) -> int:
        with self._locked():
            return sum(s.held_bytes for s in self._shares.values())

    def stats(self) -> dict:
        """{"total_bytes", "held_bytes", "unclaimed_bytes" (what no share holds, reserves for a
        resize under way or keeps as its minimum), "shares": {name: ShareStats}}."""
        with self._locked():
            return {"total_bytes": self.total_bytes, "held_bytes": self.held_bytes,
                    "unclaimed_bytes": self.total_bytes - sum(s._claim
                                                              for s in self._shares.values()),
                    "shares": {n: ShareStats(**vars(s.stats)) for n, s in self._shares.items()}}
