"""KindTable against a shadow (per (kind, group) the member pages backed): random takes of a
group (every kind backed alike), grows, shrinks and releases of one kind, frees of a group,
each inside a transaction committed or rolled back at random; after every rule each extent
has its shadow's length, a page backs one (kind, group) only, the ledger names each page's
kind and counts what each kind holds, and free + held pages == the pool. A grow past the free
pages raises OutOfCapacityError and changes nothing."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
import pytest

from vmemkv.scheduler.errors import OutOfCapacityError
from vmemkv.scheduler.managers.journal import TxnCell
from vmemkv.scheduler.managers.kinds import KindSpec, KindTable

from ..hypothesis_budget import examples
from .shadow import in_transaction

KINDS = (KindSpec("full", (1,)), KindSpec("window-8", (0, 2), 8))   # members: 2 and 4
POOL, GROUPS, K = 40, 6, 3                                          # k = 3 pages a member
GROUP, KIND, PAGES = st.integers(0, GROUPS - 1), st.integers(0, 1), st.integers(0, K)


class KindTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cell = TxnCell()
        self.table = KindTable(self.cell, KINDS, True, GROUPS, POOL)
        self.shadow = {(k, g): 0 for k in range(2) for g in range(GROUPS)}

    def _txn(self, change, commit: bool) -> None:
        before = dict(self.shadow)
        if not in_transaction(self.cell, change, commit):
            self.shadow = before

    def _resize(self, k: int, g: int, pages: int) -> None:
        grow = (pages - self.shadow[k, g]) * self.table.members[k]
        if grow > self.table.ledger.free_pages:
            with pytest.raises(OutOfCapacityError):
                self.table.resize(k, g, pages)
            return
        held = set(self._held())
        new = self.table.resize(k, g, pages)
        assert len(new) == max(grow, 0) and not set(new) & held   # taken pages were free
        self.shadow[k, g] = pages

    def _held(self) -> list:
        return [p for (k, g) in self.shadow for p in self.table.extent(k, g)
                if self.table.ledger.holder(p) is not None]

    @rule(g=GROUP, pages=PAGES, commit=st.booleans())
    def take(self, g, pages, commit):
        """Back every kind of ``g`` alike (WHOLE: k pages; BYTES: what its fill needs)."""
        def change():
            for k in range(2):
                self._resize(k, g, pages)
        self._txn(change, commit)

    @rule(k=KIND, g=GROUP, pages=PAGES, commit=st.booleans())
    def grow_or_shrink(self, k, g, pages, commit):
        self._txn(lambda: self._resize(k, g, pages), commit)

    @rule(g=GROUP, commit=st.booleans())
    def release_window(self, g, commit):
        self._txn(lambda: self._resize(1, g, 0), commit)

    @rule(g=GROUP, commit=st.booleans())
    def free(self, g, commit):
        def change():
            for k in range(2):
                self._resize(k, g, 0)
        self._txn(change, commit)

    @invariant()
    def matches_shadow(self):
        table, ledger = self.table, self.table.ledger
        table.check_integrity()
        pages = []
        for (k, g), backed in self.shadow.items():
            extent = table.extent(k, g)
            assert len(extent) == backed * table.members[k] and table.backed(k, g) == backed
            assert all(ledger.holder(p) == KINDS[k].name for p in extent)
            pages += extent
        assert len(pages) == len(set(pages)), "a pool page backs two extents"
        assert ledger.free_pages + len(pages) == POOL
        assert all(table.pages_of(g) == sum(len(table.extent(k, g)) for k in range(2))
                   for g in range(GROUPS))


TestKindTableMachine = KindTableMachine.TestCase
TestKindTableMachine.settings = settings(max_examples=examples(100), stateful_step_count=30,
                                         deadline=None)
