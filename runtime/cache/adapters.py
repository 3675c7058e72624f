"""LoRA adapter memory in a cache (issue 31): the replica of resident adapters and the checks of
``LoadAdapter`` / ``EvictAdapter``, shared by both cache kinds.

A plan's LoadAdapter names the units (vmem pool pages, paged blocks) an adapter's bytes live in,
in order; the cache makes that memory (vmem: the pool pages mapped, in order, into a
VirtualRange of their own over the KV pool; paged: a buffer of its own, the blocks being the
adapter's share of the block budget) and ``adapter_buffer(adapter_id)`` is a 1-D uint8 view of
its ``num_bytes``, zero-copy, for the caller to write the weights into after the plan ran.
EvictAdapter gives the memory back. Both are checked against the replica when a plan is bound
(CacheStateError, nothing changed): a load of a resident adapter or into units another adapter
holds (or, vmem, the KV range maps), the wrong number of units, an evict of what is not
resident or with other units.
"""
from __future__ import annotations

from typing import Callable, Optional

from vmemkv.scheduler.plan import EvictAdapter, LoadAdapter

from ..errors import CacheStateError

ADAPTER_OPS = (LoadAdapter, EvictAdapter)


class AdapterReplica:
    """Mixed into the caches: ``_adapters`` {adapter_id: (units, num_bytes)} as plans left it."""

    def _init_adapters(self, unit_bytes: int, num_units: int) -> None:
        self._adapters: dict = {}
        self._adapter_units_held: set = set()    # every unit of ``_adapters`` (kept with it)
        self._adapter_unit_bytes = unit_bytes    # bytes of one unit (a pool page, a block)
        self._adapter_units = num_units          # units the ops may name: 0..num_units-1

    def resident_adapters(self) -> dict:
        """{adapter_id: (units, num_bytes)} of every adapter the plans left resident."""
        return dict(self._adapters)

    def _adapter_held_units(self) -> set:
        return self._adapter_units_held

    def _bind_adapter(self, op, undo: Callable, busy: Optional[Callable[[], set]] = None) -> tuple:
        """Check ``op`` against the replica and apply it there (``undo`` gets its inverse);
        returns its units. ``busy()``: units a load may not name besides adapters' (vmem: the
        ones the KV range maps)."""
        adapters, name = self._adapters, op.adapter_id
        if not isinstance(name, str) or not name:
            raise CacheStateError(f"{op!r}: adapter_id must be a non-empty str")
        if isinstance(op, EvictAdapter):
            held = adapters.get(name)
            if held is None or tuple(op.pool_pages) != held[0]:
                raise CacheStateError(f"{op!r}: evicts what is not resident as named (the "
                                      f"replica holds {held!r})")
            del adapters[name]
            self._adapter_units_held.difference_update(held[0])
            undo(lambda: (adapters.__setitem__(name, held),
                          self._adapter_units_held.update(held[0])))
            return held[0]
        units, n = op.pool_pages, op.num_bytes
        if name in adapters:
            raise CacheStateError(f"{op!r}: adapter {name[:12]} is resident already")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise CacheStateError(f"{op!r}: num_bytes must be an int >= 1")
        if not isinstance(units, tuple) or len(set(units)) != len(units) or any(
                isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < self._adapter_units
                for u in units):
            raise CacheStateError(f"{op!r}: pool_pages must be distinct units of 0.."
                                  f"{self._adapter_units - 1}")
        if len(units) != -(-n // self._adapter_unit_bytes):
            raise CacheStateError(f"{op!r}: {n} bytes take {-(-n // self._adapter_unit_bytes)} "
                                  f"units of {self._adapter_unit_bytes} bytes, not {len(units)}")
        taken = (self._adapter_held_units() | (busy() if busy is not None else set())) \
            .intersection(units)
        if taken:
            raise CacheStateError(f"{op!r} names units in use: {sorted(taken)[:8]}")
        adapters[name] = (units, n)
        self._adapter_units_held.update(units)
        undo(lambda: (adapters.pop(name, None), self._adapter_units_held.difference_update(units)))
        return units

    def _check_adapter_replica(self) -> None:
        units = [u for held, _ in self._adapters.values() for u in held]
        assert len(units) == len(set(units)) and set(units) == self._adapter_units_held, \
            "adapter units: each held once, the index equal to the replica"

    def _adapter_entry(self, adapter_id: str) -> tuple:
        held = self._adapters.get(adapter_id)
        if held is None:
            raise CacheStateError(f"adapter {str(adapter_id)[:12]} is not resident: no plan "
                                  f"loaded it (or it was evicted)")
        return held
