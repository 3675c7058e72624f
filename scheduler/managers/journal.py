"""Undo journal of a manager transaction: ``begin`` is O(1), ``rollback`` O(changes since begin).

``begin`` saves the manager's scalar fields by name (``ManagerCore._SAVED_FIELDS``) and opens
the manager's ``TxnCell``; every container the manager mutates in place then logs the inverse
of each change while the cell is ``active`` (nothing outside this module reads the journal):

    JList / JDict / JSet    builtin containers whose mutators log (reading costs what the
                            builtin's does); an unlogged mutator raises TypeError
    OrderedUnits            an insertion-ordered set (LRU lists, free-slot buckets) whose
                            removal from the middle is undone exactly (lazy deletion)
    the unit arrays         ``_refs``/``_fill``, plain lists for the hot paths: the manager
                            saves a unit's pair before its first write (``UnitOps._touch``)
    sequence records        saved at their first change (``TxnCell.record``/``record_tokens``)

``rollback`` replays the inverses newest first, which restores each container exactly
(order included), then the unit pairs, the records and the saved fields. Every log entry is
written BEFORE its change and puts a value back (an item, a length, a front entry) rather
than inverting an operation, so an exception between the log and the change (a
KeyboardInterrupt anywhere) still leaves a journal whose replay is exact. Outside a
transaction every logging path costs one test of the cell, the append hot path included
(``UnitOps.append`` takes a logged copy of it while the cell is active).
What is copied rather than logged, each bounded by what the step touches or holds pending,
not by the pool: a record's block table at its first change other than a hot append
(O(that sequence's units)), and the pending ops at begin.
"""
from __future__ import annotations

from collections import deque

MISSING = object()


class TxnCell:
    """The open transaction of one manager and its helpers, and its undo journal: containers
    and setters log to it only while ``active`` (nothing outside this module reads the log)."""

    __slots__ = ("active", "fields", "undo", "units", "records")

    def __init__(self) -> None:
        self.active = False     # a transaction is open (read it, never write it)
        self._clear({})

    def _clear(self, fields: dict) -> None:
        self.fields = fields    # the manager's saved fields at begin, by name
        self.undo: list = []    # (fn, *args): call fn(*args) to undo one change
        self.units: dict = {}   # unit -> (refs, fill) before its first write
        self.records: dict = {}   # id(seq) -> [seq, num_tokens, snapshot or None]

    # ``active`` is set after the log is fresh and cleared before it is replayed or dropped, so
    # an interrupt at any line never leaves an active cell with a stale log.
    def open(self, fields: dict) -> None:
        """Start logging; ``fields`` are the values ``rollback`` returns (saved by name)."""
        self._clear(fields)
        self.active = True

    def commit(self) -> None:
        """Keep every change: drop the log (O(1))."""
        self.active = False
        self._clear({})

    def rollback(self, refs: list, fill: list) -> dict:
        """Undo every logged change, newest first (``refs``/``fill``: the unit arrays
        ``save_unit`` saved from), and close; returns the fields given to ``open``."""
        self.active = False     # first: the undo steps log nothing
        for step in reversed(self.undo):
            step[0](*step[1:])
        for unit, (r, f) in self.units.items():
            refs[unit], fill[unit] = r, f
        for seq, num_tokens, saved in self.records.values():
            if saved is not None:
                seq.restore(saved)
            seq.num_tokens = num_tokens
        fields = self.fields
        self._clear({})
        return fields

    def size(self) -> int:
        """Entries the log holds: what begin and each change cost, whatever the pool holds."""
        return len(self.fields) + len(self.undo) + len(self.units) + len(self.records)

    def log(self, *step) -> None:
        """Inside a transaction, remember ``step`` = (fn, *args): ``fn(*args)`` undoes one change
        (written before the change it undoes)."""
        if self.active:
            self.undo.append(step)

    def set(self, obj, name: str, value) -> None:
        """``setattr(obj, name, value)``, the old value logged inside a transaction."""
        if self.active:
            self.undo.append((setattr, obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def save_unit(self, unit: int, refs: list, fill: list) -> None:
        """Inside a transaction, save ``unit``'s (refs, fill) pair before its first write."""
        if self.active and unit not in self.units:
            self.units[unit] = (refs[unit], fill[unit])

    def record_tokens(self, seq) -> None:
        """Inside a transaction, save ``seq.num_tokens`` before its first change."""
        if self.active and id(seq) not in self.records:
            self.records[id(seq)] = [seq, seq.num_tokens, None]

    def record(self, seq) -> None:
        """Inside a transaction, save the whole record ``seq`` before its first change."""
        if self.active:
            entry = self.records.get(id(seq))
            if entry is None:
                self.records[id(seq)] = [seq, seq.num_tokens, seq.snapshot()]
            elif entry[2] is None:
                entry[2] = seq.snapshot()   # only num_tokens changed so far: it is in entry[1]


def put_back(container, key, old) -> None:
    if old is MISSING:
        container.pop(key, None)
    else:
        container[key] = old


def cut_to(items: list, length: int) -> None:
    """Put ``items`` back to its first ``length`` items (undoes appends, whether made or not)."""
    list.__delitem__(items, slice(length, None))


def put_last(items: list, length: int, value) -> None:
    """Put ``items`` back to ``length`` items ending in ``value`` (undoes a pop, made or not)."""
    list.__delitem__(items, slice(length - 1, None))
    list.append(items, value)


def put_front(queue: deque, entry) -> None:
    """Put ``entry`` back at the front of ``queue`` unless it is still there (undoes popleft)."""
    if not queue or queue[0] is not entry:
        queue.appendleft(entry)


def _refuse(name: str):
    def refused(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__}.{name} is not journaled; use a logged mutator")
    refused.__name__ = name
    return refused


class JList(list):
    """A list whose item writes, append and pop() log their inverse (other mutators refuse)."""

    def __init__(self, cell: TxnCell, items=()) -> None:
        super().__init__(items)
        self._cell = cell

    def __reduce__(self):      # copy/pickle: the cell first (pickle's own would extend first)
        return (JList, (self._cell, list(self)))

    def __setitem__(self, index: int, value) -> None:
        cell = self._cell
        if cell.active:
            cell.undo.append((list.__setitem__, self, index, list.__getitem__(self, index)))
        list.__setitem__(self, index, value)

    def append(self, value) -> None:
        cell = self._cell
        if cell.active:
            cell.undo.append((cut_to, self, len(self)))
        list.append(self, value)

    def pop(self):
        cell = self._cell
        if cell.active:
            cell.undo.append((put_last, self, len(self), list.__getitem__(self, -1)))
        return list.pop(self)

    for _name in ("__delitem__", "__iadd__", "__imul__", "extend", "insert", "remove", "clear",
                  "sort", "reverse"):
        locals()[_name] = _refuse(_name)
    del _name


class JDict(dict):
    """A dict whose item writes, deletes and pop log their inverse (key order is not kept
    across a rollback: use it where order means nothing; OrderedUnits where it does)."""

    def __init__(self, cell: TxnCell, items=()) -> None:
        super().__init__(items)
        self._cell = cell

    def __reduce__(self):      # copy/pickle: the cell first
        return (JDict, (self._cell, dict(self)))

    def __setitem__(self, key, value) -> None:
        cell = self._cell
        if cell.active:
            cell.undo.append((put_back, self, key, dict.get(self, key, MISSING)))
        dict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        old = dict.__getitem__(self, key)
        cell = self._cell
        if cell.active:
            cell.undo.append((dict.__setitem__, self, key, old))
        dict.__delitem__(self, key)

    def pop(self, key, default=MISSING):
        if key not in self:
            if default is MISSING:
                raise KeyError(key)
            return default
        old = self[key]
        del self[key]
        return old

    for _name in ("__ior__", "popitem", "setdefault", "update", "clear"):
        locals()[_name] = _refuse(_name)
    del _name


class JSet(set):
    """A set whose add, discard, remove and clear log their inverse."""

    def __init__(self, cell: TxnCell, items=()) -> None:
        super().__init__(items)
        self._cell = cell

    def __reduce__(self):      # copy/pickle: set's own would call __init__(items)
        return (JSet, (self._cell, list(self)))

    def add(self, item) -> None:
        if item not in self:
            cell = self._cell
            if cell.active:
                cell.undo.append((set.discard, self, item))
            set.add(self, item)

    def discard(self, item) -> None:
        if item in self:
            cell = self._cell
            if cell.active:
                cell.undo.append((set.add, self, item))
            set.discard(self, item)

    def remove(self, item) -> None:
        if item not in self:
            raise KeyError(item)
        self.discard(item)

    def clear(self) -> None:
        cell = self._cell
        if cell.active and self:
            cell.undo.append((set.update, self, list(self)))
        set.clear(self)

    for _name in ("__ior__", "__iand__", "__isub__", "__ixor__", "pop", "update",
                  "difference_update", "intersection_update", "symmetric_difference_update"):
        locals()[_name] = _refuse(_name)
    del _name


class OrderedUnits:
    """Insertion-ordered set of hashable keys: ``add`` at the end, ``remove`` from anywhere,
    ``first``/``pop_first`` from the front, all O(1) amortized, each undone exactly (order
    included) by the journal. A removed key's queue entry goes stale (its serial no longer
    matches) and is skipped; stale entries are dropped when they outnumber live ones."""

    __slots__ = ("_queue", "_live", "_serial", "_cell")

    def __init__(self, cell: TxnCell, keys=()) -> None:
        self._cell = cell
        self._queue: deque = deque()   # (serial, key), oldest first, stale entries included
        self._live: dict = {}          # key -> serial of its live entry
        self._serial = 0
        for key in keys:
            self.add(key)

    def _log(self, *step) -> None:
        cell = self._cell
        if cell.active:
            cell.undo.append(step)

    def add(self, key) -> None:
        """Put ``key`` (not present) at the end."""
        if len(self._queue) > 2 * len(self._live) + 64:   # compact: a new deque, old kept for undo
            self._log(setattr, self, "_queue", self._queue)
            self._queue = deque(e for e in self._queue if self._live.get(e[1]) == e[0])
        self._log(self._undo_add, key, self._serial, len(self._queue))
        self._serial += 1
        self._live[key] = self._serial
        self._queue.append((self._serial, key))

    def _undo_add(self, key, serial: int, length: int) -> None:
        while len(self._queue) > length:
            self._queue.pop()
        self._live.pop(key, None)
        self._serial = serial

    def remove(self, key) -> None:
        """Take ``key`` out (KeyError when absent)."""
        serial = self._live[key]
        self._log(dict.__setitem__, self._live, key, serial)
        del self._live[key]

    def first(self):
        """The oldest key (LookupError when empty)."""
        self._skip_stale()
        if not self._queue:
            raise LookupError("empty")
        return self._queue[0][1]

    def pop_first(self):
        """Remove and return the oldest key (LookupError when empty)."""
        key = self.first()
        self._log(put_front, self._queue, self._queue[0])
        self._queue.popleft()
        self.remove(key)
        return key

    def _skip_stale(self) -> None:
        queue, live = self._queue, self._live
        while queue and live.get(queue[0][1]) != queue[0][0]:
            self._log(put_front, queue, queue[0])
            queue.popleft()

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, key) -> bool:
        return key in self._live

    def __iter__(self):
        live = self._live
        return iter([k for s, k in self._queue if live.get(k) == s])


def journaled(value) -> bool:
    """Whether mutating ``value`` in place is undone by a rollback (or it cannot be mutated):
    the check behind the test that no manager field escapes the journal."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, frozenset, TxnCell)):
        return True
    if isinstance(value, (JList, JDict, JSet, OrderedUnits)):
        return True   # (their elements: HeldSeq records are saved by TxnCell.record)
    if type(value) is tuple:
        return all(journaled(v) for v in value)
    check = getattr(value, "journaled_fields", None)
    return check is not None and check()
