"""LoRA adapters as tenants of a manager's page ledger (issue 31): adapter weights and KV in one
physical pool, or (``adapter_budget_bytes``) a static split.

    m.acquire_adapter(ref, owner_seq_id=7)   # pinned; loaded if not resident: LoadAdapter
    m.release_adapter(ref)                   # uses 0: resident but IDLE (LRU order)
    m.evict_idle_adapter()                   # the least recently idle one: EvictAdapter

A resident adapter holds ``adapter_pages(num_bytes)`` pages (vmem pool pages, paged blocks) of
the ledger as tenant ``("adapter", digest)``, in byte order. Who gives way to whom:

    an adapter loads   from free pages, then what the pool's ``_gather`` frees for KV's own
                       shrink (free groups, reclaimable groups, cached prefix groups in
                       eviction order), then idle adapters (least recently idle first)
    KV needs pages     free pages, free/reclaimable/cached groups (blocks), then idle adapters:
                       a manager's own reclaim evicts them (``_evict_adapter_for_kv``), so an
                       allocation, an append or a swap-in fails, and the scheduler preempts or
                       waits, only once no adapter is idle; ``_available_units`` counts their
                       pages as room, as it counts the prefix cache's
    pinned adapters    are never evicted: their pages count as held, like a running sequence's

Static split (``adapter_budget_bytes``): adapters take pages of a second PageLedger of that
many bytes' units, whose page ids follow the KV pool's in the ops (``_adapter_offset``); KV
keeps the rest of the bytes; neither ever evicts the other. Same code, another ledger.

Every container is journaled (``_resident``: digest -> Resident, replaced never edited;
``_idle_adapters``: OrderedUnits), the counters are saved fields, so a rollback restores
adapters, their use counts, the LRU order and the ledger exactly.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from ..adapters import AdapterRef, AdapterStateError
from ..errors import ConfigError, OutOfCapacityError
from .base import AdapterStats, EvictAdapter, LoadAdapter
from .common import check_int
from .journal import JDict, OrderedUnits
from .ledger import RELEASED, PageLedger


class Resident(NamedTuple):
    """A resident adapter: its ref, the ledger pages holding its bytes (in order), its uses."""
    ref: AdapterRef
    pages: tuple
    uses: int


def adapter_budget_units(budget: Optional[int], unit_bytes: int, cache_bytes: int,
                         unit: str) -> Optional[int]:
    """Units a static split gives adapters (None: one shared pool); ConfigError naming the
    field when the budget buys no unit or leaves KV nothing."""
    if budget is None:
        return None
    check_int("adapter_budget_bytes", budget, 1)
    units = budget // unit_bytes
    if units < 1:
        raise ConfigError(f"adapter_budget_bytes={budget} holds no {unit} of {unit_bytes} bytes; "
                          f"needs >= {unit_bytes} (or None: adapters share the KV pool)")
    if budget >= cache_bytes:
        raise ConfigError(f"adapter_budget_bytes={budget} leaves no KV cache in cache_bytes="
                          f"{cache_bytes}; it must be below cache_bytes")
    return units


class AdapterTenancy:
    """Mixed into VmemManager and PagedManager. The manager supplies ``_free_one()`` (one
    more of its KV ledger's units freed for another use, idle adapters last),
    ``_available_units`` (counting idle adapters' pages), ``_kv_capacity_units`` (now, or at
    a pool size) and ``_tokens_in_units`` (the longest sequence that many units hold)."""

    def _init_adapters(self, kv_ledger: PageLedger, unit_bytes: int,
                       budget_units: Optional[int], offset: int, unit_name: str) -> None:
        cell = self._cell
        self._adapter_unit_bytes = unit_bytes
        self._adapter_unit_name = unit_name
        self._adapters_share_kv = budget_units is None
        self._adapter_ledger = kv_ledger if budget_units is None else \
            PageLedger(cell, budget_units)
        self._adapter_offset = 0 if budget_units is None else offset   # split: ids after KV's
        self._resident = JDict(cell)              # digest -> Resident
        self._idle_adapters = OrderedUnits(cell)  # digests of uses 0, least recently idle first
        self._adapter_idle_pages = 0              # pages of idle adapters
        self._adapter_pages_held = 0              # pages of resident adapters
        self.adapter_loads = self.adapter_evictions = 0

    _ADAPTER_FIXED = frozenset({"_adapter_unit_bytes", "_adapter_unit_name",
                                "_adapters_share_kv", "_adapter_offset", "adapter_budget_bytes"})
    _ADAPTER_SAVED = ("_adapter_idle_pages", "_adapter_pages_held", "adapter_loads",
                      "adapter_evictions")
    _ADAPTER_JOURNALED = frozenset({"_adapter_ledger", "_resident", "_idle_adapters"})

    def _gather(self, count: int, consume) -> int:
        """THE way units nobody holds are freed for another use (an adapter's, the device's):
        ``consume(n)`` takes n free units off the KV ledger as they become free, until
        ``count`` are taken or the manager's ``_free_one`` has nothing left; returns how many
        were consumed."""
        got, ledger = 0, self._kv_ledger()
        while got < count:
            free = ledger.free_pages
            if free:
                n = min(free, count - got)
                consume(n)
                got += n
            elif not self._free_one():
                break
        return got

    # -- sizes --
    def adapter_pages(self, num_bytes: int) -> int:
        check_int("num_bytes", num_bytes, 1)
        return -(-num_bytes // self._adapter_unit_bytes)

    def max_adapter_pages(self) -> int:
        """Shared pool: every page of it (an elastic pool: at its max); split: the budget's."""
        return self._adapter_ledger.num_pages

    def max_sequence_tokens_with_adapter(self, adapter: AdapterRef,
                                         cache_bytes: Optional[int] = None) -> int:
        left = self.kv_units_beside_adapter(adapter, cache_bytes)
        if left < 0 or not self._adapters_share_kv:
            return 0 if left < 0 else self.max_sequence_tokens
        return min(self.max_seq_len, self._tokens_in_units(left))

    def kv_units_beside_adapter(self, adapter: AdapterRef,
                                cache_bytes: Optional[int] = None) -> int:
        """Pool units KV may hold while ``adapter`` is resident, in a pool of ``cache_bytes``
        (None: as it is); -1 when the adapter can never load."""
        ref = self._check_ref(adapter)
        pages = self.adapter_pages(ref.num_bytes)
        if not self._adapters_share_kv:
            return -1 if pages > self._adapter_ledger.num_pages else \
                self._kv_capacity_units(cache_bytes)
        return max(-1, self._kv_capacity_units(cache_bytes) - pages)

    def pool_units(self, cache_bytes: int) -> int:
        return self._kv_capacity_units(cache_bytes)

    @property
    def pool_sequence_tokens(self) -> int:
        return self._tokens_in_units(self._kv_capacity_units())

    @property
    def _kv_adapter_pages(self) -> int:
        """Pages adapters hold in the KV ledger (0 in a static split)."""
        return self._adapter_pages_held if self._adapters_share_kv else 0

    @property
    def _kv_idle_adapter_pages(self) -> int:
        """Pages of idle adapters KV may take (0 in a static split)."""
        return self._adapter_idle_pages if self._adapters_share_kv else 0

    def _check_ref(self, adapter) -> AdapterRef:
        if not isinstance(adapter, AdapterRef):
            raise ConfigError(f"an adapter must be an AdapterRef, got {adapter!r}")
        rec = self._resident.get(adapter.digest)
        if rec is not None and rec.ref.num_bytes != adapter.num_bytes:
            raise AdapterStateError(f"adapter {adapter} has the digest of resident adapter "
                                    f"{rec.ref}, with another size")
        return adapter

    def _adapter_room(self) -> int:
        """Pages an adapter load may take: free, and all a reclaim could free."""
        if self._adapters_share_kv:
            return self._available_units()
        return self._adapter_ledger.free_pages + self._adapter_idle_pages

    def _adapter_kv_cost(self, adapter: AdapterRef) -> int:
        """Units acquiring ``adapter`` takes from what KV may use (``_available_units``)."""
        rec = self._resident.get(adapter.digest)
        if not self._adapters_share_kv or (rec is not None and rec.uses):
            return 0
        return self.adapter_pages(adapter.num_bytes)   # loaded, or an idle one pinned

    # -- use counts --
    def can_acquire_adapter(self, adapter: AdapterRef) -> bool:
        ref = self._check_ref(adapter)
        return ref.digest in self._resident or \
            self.adapter_pages(ref.num_bytes) <= self._adapter_room()

    def acquire_adapter(self, adapter: AdapterRef, owner_seq_id: Optional[int] = None) -> None:
        ref = self._check_ref(adapter)
        digest = ref.digest
        rec = self._resident.get(digest)
        if rec is not None:
            if not rec.uses:          # idle: pinned again, no op
                self._idle_adapters.remove(digest)
                self._adapter_idle_pages -= len(rec.pages)
            self._resident[digest] = rec._replace(uses=rec.uses + 1)
            return
        need, room = self.adapter_pages(ref.num_bytes), self._adapter_room()
        if need > room:
            raise OutOfCapacityError(
                f"adapter {ref} needs {need} {self._adapter_unit_name}s of "
                f"{self._adapter_unit_bytes} bytes; {room} could be freed "
                f"({self._adapter_ledger.free_pages} free, "
                f"{len(self._resident) - len(self._idle_adapters)} adapters pinned)")
        ledger, tenant, pages = self._adapter_ledger, ref.tenant, []
        if self._adapters_share_kv:
            self._gather(need, lambda n: pages.extend(ledger.take(n, tenant)))
        else:
            while ledger.free_pages < need and self.evict_idle_adapter():
                pass
            pages.extend(ledger.take(need, tenant))
        assert len(pages) == need, (need, len(pages))     # room was counted
        self._resident[digest] = Resident(ref, tuple(pages), 1)
        self._adapter_pages_held += need
        self.adapter_loads += 1
        self._ops.append(LoadAdapter(digest, self._op_pages(pages), ref.num_bytes,
                                     owner=owner_seq_id))

    def release_adapter(self, adapter: AdapterRef) -> None:
        ref = self._check_ref(adapter)
        rec = self._resident.get(ref.digest)
        if rec is None or not rec.uses:
            raise AdapterStateError(f"adapter {ref} released more often than acquired (it is "
                                    f"{'idle' if rec is not None else 'not resident'})")
        self._resident[ref.digest] = rec._replace(uses=rec.uses - 1)
        if rec.uses == 1:
            self._idle_adapters.add(ref.digest)
            self._adapter_idle_pages += len(rec.pages)

    def evict_idle_adapter(self) -> bool:
        if not self._idle_adapters:
            return False
        digest = self._idle_adapters.pop_first()
        rec = self._resident.pop(digest)
        self._adapter_ledger.give(rec.pages)
        self._adapter_idle_pages -= len(rec.pages)
        self._adapter_pages_held -= len(rec.pages)
        self.adapter_evictions += 1
        self._ops.append(EvictAdapter(digest, self._op_pages(rec.pages)))
        return True

    def _evict_adapter_for_kv(self) -> bool:
        """KV's last resort before it fails: an idle adapter's pages back to the KV ledger."""
        return self._adapters_share_kv and self.evict_idle_adapter()

    def _op_pages(self, pages) -> tuple:
        offset = self._adapter_offset
        return tuple(p + offset for p in pages) if offset else tuple(pages)

    # -- queries --
    def adapter_uses(self, adapter: AdapterRef) -> int:
        rec = self._resident.get(self._check_ref(adapter).digest)
        return 0 if rec is None else rec.uses

    def resident_adapters(self) -> dict:
        return {d: (self._op_pages(rec.pages), rec.ref.num_bytes)
                for d, rec in self._resident.items()}

    def adapter_stats(self) -> AdapterStats:
        return AdapterStats(resident=len(self._resident),
                            pinned=len(self._resident) - len(self._idle_adapters),
                            pages=self._adapter_pages_held, idle_pages=self._adapter_idle_pages,
                            loads=self.adapter_loads, evictions=self.adapter_evictions)

    # -- integrity --
    def _check_adapters(self, kv_tenant) -> None:
        """Every adapter page held once by its adapter, every ledger page accounted once:
        free + KV tenants (``kv_tenant(t)``) + adapter tenants + RELEASED == pool."""
        ledger, idle = self._adapter_ledger, list(self._idle_adapters)
        assert len(set(idle)) == len(idle) == len(self._idle_adapters), "idle adapters"
        held = idle_pages = 0
        for digest, rec in self._resident.items():
            tenant = rec.ref.tenant
            assert rec.ref.digest == digest and rec.uses >= 0, ("adapter record", digest)
            assert len(rec.pages) == self.adapter_pages(rec.ref.num_bytes), ("pages", digest)
            assert ledger.held(tenant) == len(rec.pages) == len(set(rec.pages)), digest
            assert all(ledger.holder(p) == tenant for p in rec.pages), ("holder", digest)
            assert (rec.uses == 0) == (digest in self._idle_adapters), ("idle", digest)
            held += len(rec.pages)
            idle_pages += 0 if rec.uses else len(rec.pages)
        assert (held, idle_pages) == (self._adapter_pages_held, self._adapter_idle_pages)
        adapters = {rec.ref.tenant for rec in self._resident.values()}
        if not self._adapters_share_kv:
            ledger.check_integrity()
            assert set(ledger.tenants()) == adapters, "split: only adapters hold its pages"
            kv = self._kv_ledger()
        else:
            kv = ledger
        tenants = kv.tenants()
        assert all(t == RELEASED or kv_tenant(t) or t in adapters for t in tenants), tenants
        assert kv.free_pages + sum(tenants.values()) == kv.num_pages, "pages accounted once"
