"""A vmem manager's free slots take memory for the counts free slots have, never one bucket per
possible count: ``FreeSlots`` built one (about 900 bytes) for each of 0..pages_per_slot up
front, so a 10 MB simulated cache at ``--max-len 2000000`` held 953 MB resident. The choice
order (most pages mapped, then earliest filed) and exact rollback are unchanged: checked on a
seeded random sequence of operations and transactions against a plain shadow."""
from __future__ import annotations

import random
import sys
import tracemalloc

import vmemkv.scheduler.managers.journal as journal
import vmemkv.scheduler.managers.slots as slots_module
from vmemkv.scheduler.managers import VmemManager
from vmemkv.scheduler.managers.journal import TxnCell
from vmemkv.scheduler.managers.slots import FreeSlots
from vmemkv.scheduler.presets import ModelSpec

from .test_journal_interrupts import LineInterrupt

TINY = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)       # 1 byte per layer-token
BUCKET_BYTES = 900             # what one bucket (an empty OrderedUnits) took, tracemalloc
PAGES_PER_SLOT = 50_000
SMALL_BYTES = 64 * 1024        # far below PAGES_PER_SLOT * BUCKET_BYTES (45 MB)


def traced_bytes(build):
    """(current, peak) bytes tracemalloc sees while ``build()`` runs, and what it returned."""
    tracemalloc.start()
    try:
        value = build()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return current, peak, value


def test_free_slots_memory_does_not_grow_with_pages_per_slot():
    current, peak, free = traced_bytes(lambda: FreeSlots(4, PAGES_PER_SLOT))
    assert peak < SMALL_BYTES < PAGES_PER_SLOT * BUCKET_BYTES // 100
    assert len(free) == 4 and free.pick() == 0


def test_vmem_manager_with_long_slots_builds_no_bucket_per_count():
    def build():
        return VmemManager(TINY, 4 * 2 * 2, PAGES_PER_SLOT * 2, page_bytes=2, max_slots=2)
    current, peak, manager = traced_bytes(build)
    assert (manager.num_slots, manager.pages_per_slot) == (2, PAGES_PER_SLOT)
    assert peak < SMALL_BYTES


def test_counts_a_free_slot_has_left_take_no_memory():
    free = FreeSlots(3, PAGES_PER_SLOT)

    def walk():
        for count in range(1, 20_001):          # slot 0 passes through 20,000 counts
            free.recount(0, count)
        free.recount(0, 7)
    current, peak, _ = traced_bytes(walk)
    assert current < SMALL_BYTES and peak < SMALL_BYTES
    assert free.pick() == 0 and dict(free.items()) == {0: 7, 1: 0, 2: 0}


class ShadowFreeSlots:
    """The old choice order, plainly: the free slot with the largest count, earliest filed
    (filed again at each add or count change)."""

    def __init__(self, num_slots: int) -> None:
        self.serial = 0
        self.filed = {}         # slot -> (count, serial)
        for slot in range(num_slots):
            self.add(slot, 0)

    def add(self, slot: int, count: int) -> None:
        self.serial += 1
        self.filed[slot] = (count, self.serial)

    def remove(self, slot: int) -> None:
        del self.filed[slot]

    def recount(self, slot: int, count: int) -> None:
        if slot in self.filed and self.filed[slot][0] != count:
            self.add(slot, count)

    def pick(self) -> int:
        return max(self.filed, key=lambda s: (self.filed[s][0], -self.filed[s][1]))

    def order(self) -> list:
        """Every free slot in choice order (pick, remove, repeat)."""
        return sorted(self.filed, key=lambda s: (-self.filed[s][0], self.filed[s][1]))


def choice_order(free: FreeSlots, cell: TxnCell) -> list:
    """Every free slot in the order ``pick`` gives them, FreeSlots left as it was."""
    cell.open({})
    order = []
    while len(free):
        order.append(free.pick())
        free.remove(order[-1])
    cell.rollback([], [])
    return order


def random_change(rng: random.Random, free, shadow: ShadowFreeSlots, num_slots: int,
                  max_count: int) -> None:
    """One random add, remove, recount (of a free slot or not) or pick, on both."""
    op = rng.randrange(4)
    if op == 0 and len(shadow.filed) < num_slots:
        slot = rng.choice([s for s in range(num_slots) if s not in shadow.filed])
        count = rng.randrange(max_count + 1)
        free.add(slot, count)
        shadow.add(slot, count)
    elif op == 1 and shadow.filed:
        slot = rng.choice(sorted(shadow.filed))
        free.remove(slot)
        shadow.remove(slot)
    elif op == 2:
        slot, count = rng.randrange(num_slots), rng.randrange(max_count + 1)
        free.recount(slot, count)
        shadow.recount(slot, count)
    elif shadow.filed:
        assert free.pick() == shadow.pick()


def test_choice_order_and_rollback_match_the_shadow():
    rng = random.Random(20261207)
    num_slots, max_count = 12, 6                # few counts: ties and emptied buckets
    cell = TxnCell()
    free, shadow = FreeSlots(num_slots, max_count, cell), ShadowFreeSlots(num_slots)
    for round_index in range(300):
        before = choice_order(free, cell)
        saved = dict(shadow.filed), shadow.serial
        cell.open({})
        for _ in range(rng.randrange(1, 12)):
            random_change(rng, free, shadow, num_slots, max_count)
        if rng.random() < 0.5:
            cell.rollback([], [])
            shadow.filed, shadow.serial = dict(saved[0]), saved[1]
            assert choice_order(free, cell) == before, f"round {round_index}"
        else:
            cell.commit()
        assert dict(free.items()) == {s: c for s, (c, _) in shadow.filed.items()}
        assert choice_order(free, cell) == shadow.order(), f"round {round_index}"
        if shadow.filed:
            assert free.pick() == shadow.pick()


class Interrupt(LineInterrupt):
    """KeyboardInterrupt at the k-th line run inside slots.py or journal.py."""

    FILES = (journal.__file__, slots_module.__file__)


CHANGES = [lambda f: f.add(5, 3), lambda f: f.add(5, 2), lambda f: f.remove(4),
           lambda f: f.remove(0), lambda f: f.recount(4, 1), lambda f: f.recount(1, 0),
           lambda f: f.recount(2, 9), lambda f: f.pick()]


def test_a_change_interrupted_at_any_line_rolls_back_exactly():
    for index, change in enumerate(CHANGES):
        for k in range(1, 10**3):
            cell = TxnCell()
            free = FreeSlots(6, 9, cell)   # counts: 0 -> {0, 3}, 2 -> {1, 2}, 4 -> {4}; 5 held
            free.remove(5)
            for slot, count in ((1, 2), (2, 2), (4, 4)):
                free.recount(slot, count)
            before = choice_order(free, cell), dict(free.items())
            cell.open({})
            interrupt = Interrupt(k)
            sys.settrace(interrupt)
            try:
                change(free)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            cell.rollback([], [])
            after = choice_order(free, cell), dict(free.items())
            assert after == before, f"change {index}, interrupted at line {k}"
            if not interrupt.fired:
                break
        assert k > 1   # each change ran at least one line
