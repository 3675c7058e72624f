"""Prefix sharing by verified chain digests, and the per-sequence record (shared by all managers).

A *unit* is a paged block or a vmem page group; ``unit_tokens`` is how many tokens it holds.
Only FULL units are shared. Unit k of a sequence is keyed by a digest chained on unit k-1's and
seeded by the scope (namespace, cache salt, LoRA adapter digest: ``prefix_scope``), so equal
digests name equal whole prefixes and units computed under different weights never match:

    root = H(b"vmemkv-prefix" [| enc] | ns)    d0 = H(root | ids[0:U])    d1 = H(d0 | ids[U:2U])  ...

``enc`` is the K/V encoding when it is not the model's dtype (``ModelSpec.kv_encoding``: the
``kv_cache_dtype`` and its scales), so units stored in one encoding never match another's.

H is SHA-256 (hashlib) over the ids as int64 bytes. A digest is only a lookup key: the index
keeps every cached unit's token ids and the registration it was chained on, and a match checks
both, so a digest that collides (crafted, or a test that forces one) is a miss, never a hit.
"""
from __future__ import annotations

import hashlib
import json
from array import array
from functools import lru_cache
from typing import NamedTuple, Optional, Sequence

from ..errors import ConfigError
from .journal import JDict, JSet, TxnCell, journaled

TOKEN_BYTES = 8   # each token id is hashed and stored as one int64


def token_bytes(ids: Sequence[int]) -> bytes:
    """The ids as int64 bytes (what is hashed and verified); ConfigError for a non-int64 id."""
    try:
        return array("q", ids).tobytes()
    except (OverflowError, TypeError):
        bad = next((t for t in ids if not _is_int64(t)), None)
        raise ConfigError(f"token id {bad!r} is not an int in [-2**63, 2**63)") from None


def _is_int64(token) -> bool:
    try:
        array("q", [token])
    except (OverflowError, TypeError):
        return False
    return True


def unit_digest(parent: bytes, unit_tokens: bytes) -> bytes:
    """Chain digest of one full unit: its parent's digest (or the namespace root) and its ids."""
    return hashlib.sha256(parent + unit_tokens).digest()


SALT_MARK = "\x1f"   # starts a scope that carries a cache salt; Request refuses it in a namespace


def prefix_scope(namespace: Optional[str], cache_salt: Optional[str],
                 adapter_digest: Optional[str] = None) -> Optional[str]:
    """The one string the managers key prefixes by: ``namespace`` alone without a salt or an
    adapter, else a string no namespace can equal (namespaces may not start with SALT_MARK)
    naming them, so the salt and the LoRA adapter's content digest (never its name: weights
    reloaded under one name are another adapter) enter every chain digest through
    ``namespace_root``. A scope with an adapter names three parts, one without two: the two
    never collide."""
    if adapter_digest is not None:
        return SALT_MARK + json.dumps([namespace, cache_salt, adapter_digest])
    if cache_salt is None:
        return namespace
    return SALT_MARK + json.dumps([namespace, cache_salt])


@lru_cache(maxsize=256)
def namespace_root(namespace: Optional[str], kv_encoding: str = "") -> bytes:
    """The seed of every chain in ``namespace`` (None and "" are different namespaces) of K/V
    stored as ``kv_encoding`` ("": the model's dtype)."""
    tag = b"\0" if namespace is None else b"\1" + namespace.encode("utf-8", "surrogatepass")
    enc = b"\2" + kv_encoding.encode() + b"\0" if kv_encoding else b""
    return hashlib.sha256(b"vmemkv-prefix" + enc + tag).digest()


class UnitKey(NamedTuple):
    """What one full unit holds: its chain digest and its token ids (int64 bytes)."""
    digest: bytes
    tokens: bytes


def unit_keys(data: bytes, unit_tokens: int, parent: bytes) -> list:
    """Keys of the full units in ``data`` (token bytes), chained on ``parent``."""
    width, keys, new_key = unit_tokens * TOKEN_BYTES, [], tuple.__new__   # (hot: no __new__ call)
    for start in range(0, len(data) - width + 1, width):
        chunk = data[start:start + width]
        parent = unit_digest(parent, chunk)
        keys.append(new_key(UnitKey, (parent, chunk)))
    return keys


class CachedUnit(NamedTuple):
    """One registration: ``unit`` holds ``key``'s tokens, computed after the content of
    registration ``parent_serial`` (None: the first unit of a sequence)."""
    unit: int
    key: UnitKey
    serial: int
    parent_serial: Optional[int]


class PrefixIndex:
    """The units whose content is known (full, and not written since), by digest and by unit.

    Guarantees: a unit has at most one registration and a digest names at most one unit;
    ``match`` returns only units whose token ids AND whole chain of registrations equal the
    query's; ``drop`` of an unregistered unit is a no-op (callers may drop on every reuse).
    Registrations are immutable; every change logs to ``cell``'s open journal (journal.py).
    """

    def __init__(self, cell: Optional[TxnCell] = None) -> None:
        self._cell = cell = TxnCell() if cell is None else cell
        self.by_digest: dict = JDict(cell)   # digest -> CachedUnit
        self.by_unit: dict = JDict(cell)     # unit -> CachedUnit
        self.serials = 0                     # registrations ever made (each gets a new serial)

    def journaled_fields(self) -> bool:
        """Every field is undone by a rollback (journal.journaled)."""
        return all(journaled(v) for v in vars(self).values())

    def match(self, keys: Sequence[UnitKey]) -> list:
        """Units of the longest verified cached prefix of ``keys``."""
        units, parent = [], None
        for key in keys:
            reg = self.by_digest.get(key.digest)
            if reg is None or reg.key.tokens != key.tokens or reg.parent_serial != parent:
                break
            units.append(reg.unit)
            parent = reg.serial
        return units

    def register(self, unit: int, key: UnitKey, parent_unit: Optional[int]) -> None:
        """Name ``unit`` by ``key``, chained on ``parent_unit``'s registration (None for a first
        unit). No-op when another unit holds that digest, ``unit`` is already named, or the
        parent is not registered (the chain could not be verified)."""
        if key.digest in self.by_digest or unit in self.by_unit:
            return
        parent = None
        if parent_unit is not None:
            reg = self.by_unit.get(parent_unit)
            if reg is None:
                return
            parent = reg.serial
        self._cell.set(self, "serials", self.serials + 1)
        reg = tuple.__new__(CachedUnit, (unit, key, self.serials, parent))   # hot: no __new__ call
        self.by_digest[key.digest] = self.by_unit[unit] = reg

    def drop(self, unit: int) -> None:
        """Forget ``unit``'s content (it is about to be overwritten)."""
        reg = self.by_unit.pop(unit, None)
        if reg is not None:
            del self.by_digest[reg.key.digest]

    def check(self) -> None:
        assert len(self.by_digest) == len(self.by_unit)
        for digest, reg in self.by_digest.items():
            assert reg.key.digest == digest and self.by_unit[reg.unit] is reg, (digest, reg.unit)


class ChainedPrefixIndex(PrefixIndex):
    """A PrefixIndex where no registration outlives the one it is chained on: ``drop`` forgets
    a unit's registration with every one chained below it, however deep. A match walks a chain
    from its first unit, so below a dropped registration nothing could be reached again, and a
    stale registration would hold its digest against a later sequence registering that
    content. So every registration is reachable: what the index names, some prompt can hit."""

    def __init__(self, cell: Optional[TxnCell] = None) -> None:
        super().__init__(cell)
        self.children: dict = JDict(self._cell)   # serial -> JSet of units chained on it

    def register(self, unit: int, key: UnitKey, parent_unit: Optional[int]) -> None:
        serials_before = self.serials        # (a new registration takes the next serial)
        super().register(unit, key, parent_unit)
        parent = self.by_unit[unit].parent_serial if self.serials != serials_before else None
        if parent is not None:
            add_child(self.children, self._cell, parent, unit)

    def drop(self, unit: int) -> list:
        """Forget ``unit``'s registration and every one chained below it; returns the units
        below it whose registrations went, nearest first ([] when ``unit`` had none)."""
        return [reg.unit for reg in self.drop_chain(unit)[1:]]

    def drop_chain(self, unit: int) -> list:
        """As ``drop``; returns every registration that went, ``unit``'s first, then those
        below it nearest first ([] when ``unit`` had none)."""
        reg = self.by_unit.get(unit)
        if reg is None:
            return []
        super().drop(unit)
        if reg.parent_serial is not None:
            discard_child(self.children, reg.parent_serial, unit)
        gone = [reg]
        for dropped in gone:                          # (grows as it goes: breadth first)
            for child in sorted(self.children.pop(dropped.serial, ())):
                gone.append(self.by_unit[child])
                PrefixIndex.drop(self, child)         # (its parent's entry went just above)
        return gone

    def check(self) -> None:
        super().check()
        serials = {reg.serial for reg in self.by_unit.values()}
        chained = {(reg.parent_serial, reg.unit) for reg in self.by_unit.values()
                   if reg.parent_serial is not None}
        assert all(parent in serials for parent, _ in chained), "outlived its parent"
        assert all(self.children.values()), "an empty child set"
        assert chained == {(s, u) for s, kids in self.children.items() for u in kids}, "children"


def drop_cached_chain(index: ChainedPrefixIndex, unit: int, refs: list, cache,
                      give_back, followers=None) -> None:
    """Drop ``unit``'s registration and those below it (``index.drop``), and what
    ``followers`` (vmem's BlockIndex; None: nothing else) chained on any of them
    (``drop_chained_on``). Each unit left with nothing findable (below, or every block gone)
    that nobody holds (``refs``) was cached only to be found: it leaves ``cache`` (the
    eviction policy) and goes to ``give_back``, the manager's place for units without content."""
    if followers is None:
        unreachable = index.drop(unit)
    else:
        gone = index.drop_chain(unit)
        unreachable = [reg.unit for reg in gone[1:]] + [
            u for reg in gone for u in followers.drop_chained_on(reg.key.digest)
            if u not in index.by_unit]                # (one still registered stays findable)
    for below in dict.fromkeys(unreachable):          # (a unit below may follow its parent)
        if not refs[below]:
            cache.remove(below)
            cache.forget(below)
            give_back(below)


def add_child(children: dict, cell: TxnCell, parent: int, child: int) -> None:
    """Note ``child`` under ``parent`` in ``children`` (a JDict of parent -> JSet, journaled)."""
    kids = children.get(parent)
    if kids is None:
        kids = children[parent] = JSet(cell)
    kids.add(child)


def discard_child(children: dict, parent: int, child: int) -> None:
    """Undo ``add_child``; a parent left with no child leaves ``children``."""
    kids = children[parent]
    kids.discard(child)
    if not kids:
        del children[parent]


class HeldSeq:
    """A manager's record of one sequence it holds (mutable, slotted: no per-step allocation).
    ``units`` is the block table (paged) or page-index -> group list (vmem). ``ids`` and
    ``keys`` only grow in place (extend/append) or are rebound, never edited: ``snapshot``
    relies on that."""

    __slots__ = ("num_tokens", "units", "ids", "namespace", "keys", "reserved", "slot",
                 "published", "prompt_units")

    def __init__(self, num_tokens: int, ids: Optional[list], namespace: Optional[str]) -> None:
        self.num_tokens = num_tokens   # live tokens
        self.units: list = []          # block ids / group ids, index = unit index
        self.ids = ids                 # known token ids (may run ahead of num_tokens); None: unknown
        self.namespace = namespace
        self.keys: list = []           # UnitKeys of units 0..len-1 (all full)
        self.reserved = 0              # reserve managers: tokens held
        self.slot = -1                 # vmem: batch row
        self.published = 0             # leading units offered to the prefix index (computed)
        self.prompt_units = 0          # full units it was allocated with (set once, never undone)

    def copy(self) -> "HeldSeq":
        c = HeldSeq(self.num_tokens, None if self.ids is None else list(self.ids), self.namespace)
        c.units, c.keys = list(self.units), list(self.keys)
        c.reserved, c.slot, c.published = self.reserved, self.slot, self.published
        c.prompt_units = self.prompt_units
        return c

    def snapshot(self) -> tuple:
        """Everything ``restore`` needs to undo later calls: O(len(units)), ids and keys by
        length (they only grow in place)."""
        ids = self.ids
        return (self.num_tokens, list(self.units), ids, 0 if ids is None else len(ids),
                self.keys, len(self.keys), self.reserved, self.slot, self.published)

    def restore(self, saved: tuple) -> None:
        """Put back the state ``snapshot`` returned (the record may have changed since)."""
        self.num_tokens, self.units, self.ids, num_ids, self.keys, num_keys, self.reserved, \
            self.slot, self.published = saved
        if self.ids is not None:
            del self.ids[num_ids:]
        del self.keys[num_keys:]

    def note_ids(self, old_tokens: int, token_ids: Optional[Sequence[int]]) -> None:
        """Record the ids of tokens appended after ``old_tokens``; forget all ids once a gap
        appears (later units then can never be shared)."""
        ids = self.ids
        if ids is None:
            return
        if len(ids) == old_tokens and token_ids is not None:
            ids.extend(token_ids)
        elif len(ids) < self.num_tokens:
            self.ids = None

    def new_full_keys(self, unit_tokens: int, kv_encoding: str = "") -> list:
        """Key every unit that became full since the last call: [(unit_index, UnitKey)]
        (chained on ``namespace_root(self.namespace, kv_encoding)``)."""
        ids, keys = self.ids, self.keys
        if ids is None:
            return []
        k = len(keys)
        full = min(self.num_tokens, len(ids)) // unit_tokens
        parent = keys[-1].digest if keys else namespace_root(self.namespace, kv_encoding)
        new = unit_keys(token_bytes(ids[k * unit_tokens:full * unit_tokens]), unit_tokens, parent)
        keys.extend(new)
        if (full + 1) * unit_tokens <= self.num_tokens:   # a full unit whose ids are unknown
            self.ids = None
        return list(enumerate(new, k))
