"""Beam groups in the scheduler (fork, prune, preempt, admit as one) on the vmem and paged
managers, against a shadow of the units each beam holds.

The shadow names every unit (a vmem page group, a paged block) by who wrote it: a beam that
grows into a new unit writes a new one; one that writes into a partial unit another live beam
also holds copies it first (copy-on-write, a new name); a child branched from a beam holds its
parent's units; a beam preempted, pruned or finished holds nothing; an admitted (or
re-admitted) beam holds units of its own, except that a group recomputed whole shares its
history again: the prompt and the outputs all its beams have in common, in whole units and
below each one's last token, are the first admitted beam's units, and a beam sharing more with
an earlier admitted one holds that one's units of it. After every schedule and update the managers' tables
must name the same sharing: two beams hold one unit at an index exactly when the shadow says so,
and the distinct units held are the shadow's. And the group rules: a group's beams sample in the
same steps or not at all, are contiguous in ``running``, and every group ends with nothing held.
"""
from __future__ import annotations

import itertools
import math

from hypothesis import settings, strategies as st
import pytest
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from vmemkv.scheduler.request import Request, SeqState

from ..hypothesis_budget import examples
from .test_scheduler_liveness import check_states, make_scheduler

_names = itertools.count()


class BeamGroupMachine(RuleBasedStateMachine):
    POLICY, LAYOUT, PREEMPTION = "paged", "per-layer", "recompute"

    def __init__(self) -> None:
        super().__init__()
        # 48 tokens: two groups of 3 beams of up to 16 tokens do not fit at once (preemption),
        # one always does without sharing (a recomputed group holds its beams privately)
        self.sched = make_scheduler(self.POLICY, self.LAYOUT, cache_tokens=48,
                                    preemption=self.PREEMPTION, max_running=6,
                                    max_tokens_per_step=24)
        mgr = self.sched.manager
        self.unit = mgr.block_size if self.POLICY == "paged" else mgr.tokens_per_page
        self.units = {}          # seq id -> the names of the units it holds, in token order
        self.next_rid = 0
        self.preempted = 0

    # ---- the shadow ----------------------------------------------------------------------
    def _grow(self, seq_id: int, held: int) -> None:
        """``seq_id`` now holds room for ``held`` tokens: the units it wrote into."""
        units = self.units[seq_id]
        tokens = getattr(self, "_held", {}).get(seq_id, 0)
        if tokens % self.unit and held > tokens and self._shared(seq_id, len(units) - 1):
            units[-1] = next(_names)                      # copy-on-write of the partial unit
        while len(units) < math.ceil(held / self.unit):
            units.append(next(_names))

    def _shared(self, seq_id: int, index: int) -> bool:
        name = self.units[seq_id][index]
        return any(other != seq_id and len(u) > index and u[index] == name
                   for other, u in self.units.items())

    def _after_schedule(self, plan, was_swapped) -> None:
        running = {s.seq_id for s in self.sched.running}
        for seq_id in list(self.units):
            if seq_id not in running:                     # preempted (by recompute)
                del self.units[seq_id]
                self._held.pop(seq_id, None)
        starts = self._shared_starts([s for s in self.sched.running
                                      if s.seq_id not in self.units], was_swapped)
        for seq in self.sched.running:                    # appends happen in running order
            if seq.seq_id not in self.units:              # admitted: units of its own, or
                leader, count = starts.get(seq.seq_id, (None, 0))   # its leader's first ones
                self.units[seq.seq_id] = list(self.units[leader][:count]) if count else []
                self._held[seq.seq_id] = count * self.unit
            self._grow(seq.seq_id, seq.held)
            self._held[seq.seq_id] = seq.held

    def _shared_units(self, beams) -> int:
        """Whole units of history (prompt, then common outputs) all ``beams`` share, below
        each one's last token."""
        common = next((i for i, col in enumerate(zip(*(b.output for b in beams)))
                       if len(set(col)) > 1), min(len(b.output) for b in beams))
        tokens = min(beams[0].request.prompt_len + common, min(b.length for b in beams) - 1)
        return tokens // self.unit

    def _shared_starts(self, admitted, was_swapped) -> dict:
        """{beam: (the earlier admitted beam of its group it shares most with, those units)}
        for groups recomputed whole this step (every live beam admitted now, not swapped in):
        at least the units the whole group shares, which the first beam holds."""
        groups, starts = {}, {}
        for seq in admitted:
            if seq.seq_id not in was_swapped:
                groups.setdefault(seq.request.request_id, []).append(seq)
        for rid, beams in groups.items():
            siblings = [s for s in self.sched.running
                        if s.request.request_id == rid and s not in beams]
            if siblings:       # joining running siblings: the one it shares most with's units
                for b in beams:
                    best = (None, 0)
                    for sib in siblings if b.output else ():
                        units = min(self._shared_units([b, sib]), sib.num_computed // self.unit)
                        if units > best[1]:
                            best = (sib.seq_id, units)
                    if best[0] is not None:
                        starts[b.seq_id] = best
                continue
            if len(beams) < 2:
                continue
            trunk = self._shared_units(beams)
            for j, b in enumerate(beams[1:], 1):
                parent, units = beams[0], trunk
                for earlier in beams[:j]:
                    pair = self._shared_units([earlier, b])
                    if pair > units:
                        parent, units = earlier, pair
                starts[b.seq_id] = (parent.seq_id, units)
        return starts

    # ---- rules ---------------------------------------------------------------------------
    @rule(groups=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 8), st.integers(1, 8)),
                          min_size=1, max_size=3))
    def submit(self, groups):
        """Beam requests of (beam_width, prompt tokens, max new tokens)."""
        self._held = getattr(self, "_held", {})
        for width, prompt, new in groups:
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            self.sched.add_request(Request(rid, prompt, new, prompt_token_ids=[rid % 3] * prompt,
                                           beam_width=width))

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data(), steps=st.integers(1, 6))
    def run_steps(self, data, steps):
        for _ in range(steps):
            if self.sched.has_unfinished():
                self.step(data)

    def step(self, data):
        self._held = getattr(self, "_held", {})
        sched = self.sched
        was_swapped = {s.seq_id for s in sched.swapped}
        plan = sched.schedule()
        self.preempted += len(plan.preempted)
        self._after_schedule(plan, was_swapped)
        sampling = {s.seq_id for s in plan.seqs if s.sample}
        sampled = {}
        for rid in {sched.seqs[i].request.request_id for i in sampling}:
            beams = [s for s in sched.running if s.request.request_id == rid]
            live = [s for s in sched.seqs.values() if s.request.request_id == rid
                    and not s.state.is_ended]
            assert {s.seq_id for s in live} == {s.seq_id for s in beams} <= sampling, \
                f"request {rid}: a group samples whole"
            self._select(beams, data, sampled)
        sched.update(sampled)
        self._forget_ended()
        check_states(sched)
        for seq_id in list(self.units):                   # finished (max_tokens) or pruned
            seq = sched.seqs.get(seq_id)
            if seq is None or seq.state is not SeqState.RUNNING:
                del self.units[seq_id]
                self._held.pop(seq_id, None)

    def _forget_ended(self) -> None:
        """As the engine does: ended sequences' records are dropped."""
        for seq_id, seq in list(self.sched.seqs.items()):
            if seq.state.is_ended:
                self.sched.forget(seq_id)

    def _select(self, beams, data, sampled) -> None:
        """What a beam search might decide: every beam's children (0..width, width in all), or
        the group done; forks are copied into the shadow."""
        sched, width = self.sched, beams[0].beam_width
        if data.draw(st.booleans(), label="done") and data.draw(st.booleans()):
            sched.prune([b.seq_id for b in beams])
            return
        parents = data.draw(st.lists(st.sampled_from([b.seq_id for b in beams]),
                                     min_size=width, max_size=width), label="parents")
        sched.prune([b.seq_id for b in beams if b.seq_id not in parents])
        for parent in dict.fromkeys(parents):
            sampled[parent] = data.draw(st.integers(0, 2))
            children = sched.branch(parent, parents.count(parent) - 1)
            for child in children:
                sampled[child] = data.draw(st.integers(0, 2))
            self._pending = getattr(self, "_pending", []) + [(parent, c) for c in children]
        for parent, child in self._pending:               # forked by update: parent's units
            self.units[child] = list(self.units[parent])
            self._held[child] = self._held[parent]
        self._pending = []

    @precondition(lambda self: self.sched._unfinished_samples)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched._unfinished_samples)))
        for seq_id in self.sched.abort_request(rid):
            self.units.pop(seq_id, None)
        self._forget_ended()

    # ---- what must hold ------------------------------------------------------------------
    def _tables(self) -> dict:
        mgr, out = self.sched.manager, {}
        for seq_id, units in self.units.items():
            if self.POLICY == "paged":
                out[seq_id] = mgr.block_table(seq_id)[:len(units)]
            else:
                pages = mgr.mapped_pages(mgr.slot_of(seq_id))
                out[seq_id] = [pages[pi] for pi in range(len(units))]
        return out

    @invariant()
    def units_match_the_shadow(self):
        tables = self._tables()
        for a, b in itertools.combinations(self.units, 2):
            for k in range(min(len(self.units[a]), len(self.units[b]))):
                assert (tables[a][k] == tables[b][k]) == (self.units[a][k] == self.units[b][k]), \
                    f"beams {a}, {b} unit {k}: manager {tables[a][k]}/{tables[b][k]}"
        distinct = {u for units in self.units.values() for u in units}
        assert len({u for t in tables.values() for u in t}) == len(distinct)

    @invariant()
    def groups_are_contiguous_in_running(self):
        rids = [s.request.request_id for s in self.sched.running]
        runs = [rid for rid, _ in itertools.groupby(rids)]
        assert len(runs) == len(set(runs)), rids

    def teardown(self):
        sched = self.sched
        for _ in range(2000):      # what is left finishes on its own (max_tokens), nothing held
            if not sched.has_unfinished():
                break
            plan = sched.schedule()
            sched.update({i: 0 for s in plan.seqs if s.sample for i in (s.seq_id,) + s.fork_ids})
        assert not sched.has_unfinished()
        assert sched.manager.stats().live_tokens == 0
        sched.manager.check_integrity()


class VmemBeamGroupMachine(BeamGroupMachine):
    POLICY = "vmem"


class SwapBeamGroupMachine(BeamGroupMachine):
    """Groups swapped out whole where the swap space (64 tokens) holds every beam, else
    recomputed; a swapped group back whole into private memory (the shadow: units of its own)."""
    PREEMPTION = "swap"

    def teardown(self):
        super().teardown()
        SWAPS[type(self).__name__] = SWAPS.get(type(self).__name__, 0) + \
            self.sched.metrics.num_swap_preemptions


class VmemSwapBeamGroupMachine(SwapBeamGroupMachine):
    POLICY = "vmem"


SWAPS: dict = {}


_SETTINGS = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)
TestPagedBeamGroupsMatchShadow = BeamGroupMachine.TestCase
TestPagedBeamGroupsMatchShadow.settings = _SETTINGS
TestVmemBeamGroupsMatchShadow = VmemBeamGroupMachine.TestCase
TestVmemBeamGroupsMatchShadow.settings = _SETTINGS
TestPagedSwapBeamGroupsMatchShadow = SwapBeamGroupMachine.TestCase
TestPagedSwapBeamGroupsMatchShadow.settings = _SETTINGS
TestVmemSwapBeamGroupsMatchShadow = VmemSwapBeamGroupMachine.TestCase
TestVmemSwapBeamGroupsMatchShadow.settings = _SETTINGS


@pytest.mark.parametrize("machine", [SwapBeamGroupMachine, VmemSwapBeamGroupMachine])
def test_the_swap_machines_really_swap_groups(machine):
    """Not vacuous: derandomized runs of each swap machine swap groups out (and back)."""
    SWAPS.pop(machine.__name__, None)
    run_state_machine_as_test(machine, settings=settings(max_examples=20, stateful_step_count=40,
                                                         deadline=None, derandomize=True))
    assert SWAPS.get(machine.__name__, 0) > 0, SWAPS
