"""SlotMap (scheduler/managers/slots.py) against a shadow: a dict (slot, page index) -> group
and a dict slot -> owner. Both directions of the map, the free slots and their mapped-page
counts agree with the shadow after every change, and a rolled-back transaction leaves exactly
what was there before it."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from vmemkv.scheduler.errors import SlotError
from vmemkv.scheduler.managers.journal import TxnCell
from vmemkv.scheduler.managers.slots import SlotMap

from ..hypothesis_budget import examples
from .shadow import in_transaction

SLOTS, GROUPS, PAGES = 4, 6, 3
SLOT, GROUP, PAGE = st.integers(0, SLOTS - 1), st.integers(0, GROUPS - 1), st.integers(0, PAGES - 1)


class SlotMapMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cell = TxnCell()
        self.slots = SlotMap(SLOTS, GROUPS, PAGES, self.cell)
        self.mapped: dict = {}        # (slot, pi) -> group
        self.owner: dict = {}         # slot -> seq id
        self.next_id = 0

    def _txn(self, change, commit: bool) -> None:
        before = dict(self.mapped), dict(self.owner), self.next_id
        if not in_transaction(self.cell, change, commit):
            self.mapped, self.owner, self.next_id = before

    @rule(slot=SLOT, pi=PAGE, group=GROUP, commit=st.booleans())
    def put(self, slot, pi, group, commit):
        if (slot, pi) in self.mapped:
            return

        def change():
            self.slots.put(slot, pi, group)
            self.mapped[slot, pi] = group
        self._txn(change, commit)

    @rule(slot=SLOT, pi=PAGE, commit=st.booleans())
    def take(self, slot, pi, commit):
        if (slot, pi) not in self.mapped:
            return

        def change():
            assert self.slots.take(slot, pi) == self.mapped.pop((slot, pi))
        self._txn(change, commit)

    @rule(slot=st.one_of(st.none(), SLOT), commit=st.booleans())
    def occupy(self, slot, commit):
        if len(self.owner) == SLOTS:
            return
        if slot is not None and slot in self.owner:
            with pytest.raises(SlotError, match=f"slot {slot} holds sequence"):
                self.slots.check_free(self.next_id, slot)
            return

        def change():
            if slot is not None:
                self.slots.check_free(self.next_id, slot)
            else:       # the free slot with the most pages mapped
                most = max(sum(1 for s, _ in self.mapped if s == free)
                           for free in range(SLOTS) if free not in self.owner)
            got = self.slots.occupy(self.next_id, slot)
            assert slot is None or got == slot
            if slot is None:
                assert sum(1 for s, _ in self.mapped if s == got) == most
            self.owner[got] = self.next_id
            self.next_id += 1
        self._txn(change, commit)

    @rule(slot=SLOT, commit=st.booleans())
    def vacate(self, slot, commit):
        if slot not in self.owner:
            return

        def change():
            self.slots.vacate(slot)
            del self.owner[slot]
        self._txn(change, commit)

    @invariant()
    def agrees_with_the_shadow(self):
        for slot in range(SLOTS):
            assert dict(self.slots.pages[slot]) == {pi: g for (s, pi), g in self.mapped.items()
                                                     if s == slot}
            assert self.slots.owner[slot] == self.owner.get(slot)
        for group in range(GROUPS):
            assert set(self.slots.maps[group]) == {k for k, g in self.mapped.items() if g == group}
        counts = {slot: sum(1 for s, _ in self.mapped if s == slot) for slot in range(SLOTS)
                  if slot not in self.owner}
        assert dict(self.slots.free.items()) == counts
        for group in range(GROUPS):      # the lowest free slot mapping the group at page 0
            want = [s for (s, pi), g in self.mapped.items()
                    if g == group and pi == 0 and s not in self.owner]
            assert self.slots.free_slot_mapping(group) == (min(want) if want else None)


TestSlotMap = SlotMapMachine.TestCase
TestSlotMap.settings = settings(max_examples=examples(200), stateful_step_count=40,
                                deadline=None)


@pytest.mark.parametrize("slot", [-1, 4, True, 1.0, "0"])
def test_a_slot_outside_the_map_is_refused_by_name(slot):
    slots = SlotMap(SLOTS, GROUPS, PAGES, TxnCell())
    with pytest.raises(SlotError, match=r"outside this manager's slots 0\.\.3"):
        slots.check_free(7, slot)
