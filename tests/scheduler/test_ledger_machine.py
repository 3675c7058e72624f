"""PageLedger against a shadow (a dict page -> tenant): random takes and gives, each inside a
transaction that is committed or rolled back at random; after every rule the ledger equals the
shadow (free pages, each page's holder, the per-tenant counts, the released pages in order) and
its integrity check holds. A take or release of more than is free, or a restore of more than was
released, raises OutOfCapacityError and changes nothing; restore gives back the last released
first."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
import pytest

from vmemkv.scheduler.errors import ConfigError, OutOfCapacityError
from vmemkv.scheduler.managers.journal import TxnCell
from vmemkv.scheduler.managers.ledger import RELEASED, PageLedger

from ..hypothesis_budget import examples
from .shadow import in_transaction

PAGES = 12
TENANTS = ("full", "window", ("adapter", 3))


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cell = TxnCell()
        self.ledger = PageLedger(self.cell, PAGES)
        self.shadow: dict = {}            # page -> tenant, taken pages only
        self.released: list = []          # pages given back to the device, in release order

    def _txn(self, change, commit: bool) -> None:
        before = dict(self.shadow), list(self.released)
        if not in_transaction(self.cell, change, commit):
            self.shadow, self.released = before

    def _held_by_tenants(self) -> list:
        """Taken pages a tenant may give back (a released page goes back only by restore)."""
        return sorted(p for p, tenant in self.shadow.items() if tenant != RELEASED)

    def _refused(self, call, count: int) -> None:
        with pytest.raises(OutOfCapacityError):
            call(count)

    @rule(count=st.integers(0, PAGES + 2), tenant=st.sampled_from(TENANTS), commit=st.booleans())
    def take(self, count, tenant, commit):
        free = PAGES - len(self.shadow)

        def change():
            if count > free:
                with pytest.raises(OutOfCapacityError):
                    self.ledger.take(count, tenant)
                return
            pages = self.ledger.take(count, tenant)
            assert len(pages) == len(set(pages)) == count
            assert not set(pages) & self.shadow.keys()
            self.shadow.update((p, tenant) for p in pages)
        self._txn(change, commit)

    @rule(data=st.data(), commit=st.booleans())
    def give(self, data, commit):
        held = self._held_by_tenants()
        pages = data.draw(st.lists(st.sampled_from(held), unique=True) if held else st.just([]))

        def change():
            self.ledger.give(pages)
            for p in pages:
                del self.shadow[p]
        self._txn(change, commit)

    @rule(tenant=st.sampled_from(TENANTS), commit=st.booleans())
    def take_one(self, tenant, commit):
        """The per-block hot path: the page ``take(1, tenant)`` would give."""
        def change():
            if not self.ledger.free_pages:
                with pytest.raises(OutOfCapacityError):
                    self.ledger.take_one(tenant)
                return
            page = self.ledger.take_one(tenant)
            assert page not in self.shadow
            self.shadow[page] = tenant
        self._txn(change, commit)

    @rule(data=st.data(), commit=st.booleans())
    def give_one(self, data, commit):
        if not self._held_by_tenants():
            return
        page = data.draw(st.sampled_from(self._held_by_tenants()))

        def change():
            self.ledger.give_one(page)
            del self.shadow[page]
            assert self.ledger.take_one("probe") == page     # the stack's top: taken next
            self.ledger.give_one(page)
        self._txn(change, commit)

    @rule(count=st.integers(0, PAGES + 2), commit=st.booleans())
    def release(self, count, commit):
        def change():
            if count > PAGES - len(self.shadow):
                self._refused(self.ledger.release, count)
                return
            pages = self.ledger.release(count)
            assert not set(pages) & self.shadow.keys()
            self.shadow.update((p, RELEASED) for p in pages)
            self.released.extend(pages)
        self._txn(change, commit)

    @rule(beyond=st.integers(-4, 2), commit=st.booleans())
    def restore(self, beyond, commit):
        """``beyond`` pages more than were released (the boundary is where bugs live)."""
        count = max(0, len(self.released) + beyond)

        def change():
            if count > len(self.released):
                self._refused(self.ledger.restore, count)
                return
            pages = self.ledger.restore(count)
            assert list(pages) == self.released[::-1][:count]     # the last released first
            del self.released[len(self.released) - count:]
            for p in pages:
                del self.shadow[p]
        self._txn(change, commit)

    @invariant()
    def matches_shadow(self):
        ledger = self.ledger
        ledger.check_integrity()
        assert ledger.released_pages == len(self.released)
        assert ledger.in_service_pages == PAGES - len(self.released)
        assert ledger.free_pages == PAGES - len(self.shadow)
        assert [ledger.holder(p) for p in range(PAGES)] == [self.shadow.get(p) for p in range(PAGES)]
        counts: dict = {}
        for tenant in self.shadow.values():
            counts[tenant] = counts.get(tenant, 0) + 1
        assert ledger.tenants() == counts
        assert all(ledger.held(t) == counts.get(t, 0) for t in TENANTS)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=examples(100), stateful_step_count=30,
                                      deadline=None)


def test_a_fresh_ledger_hands_out_pages_in_order_and_refuses_bad_input():
    ledger = PageLedger(TxnCell(), 4)
    assert ledger.take(3, "full") == (0, 1, 2)
    with pytest.raises(OutOfCapacityError, match="'window' needs 2 pages, 1 of 4 free"):
        ledger.take(2, "window")
    assert ledger.free_pages == 1 and ledger.tenants() == {"full": 3}
    with pytest.raises(AssertionError):
        ledger.give([0, 0])               # twice in one call: nothing changes
    with pytest.raises(AssertionError):
        ledger.give([3])                  # a free page
    assert ledger.tenants() == {"full": 3}
    ledger.give([2, 0])
    assert ledger.take(2, "window") == (0, 2)
    with pytest.raises(ConfigError):
        ledger.take(1, None)
    with pytest.raises(ConfigError):
        ledger.take_one(None)
    with pytest.raises(AssertionError):
        ledger.give_one(3)                # a free page
    assert ledger.take_one("window") == 3 and ledger.free_pages == 0
    with pytest.raises(OutOfCapacityError, match="'full' needs 1 page, 0 of 4 free"):
        ledger.take_one("full")
    with pytest.raises(ConfigError):
        PageLedger(TxnCell(), 0)
