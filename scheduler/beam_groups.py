"""Beam groups: the sequences of one beam-search request, scheduled, preempted and admitted as
one (a mixin over ``Scheduler``'s fields).

A beam request (``Request.beam_width > 0``) starts as one sequence, its prompt. Every step its
caller (the engine's beam search) reads the live beams' logits and says what follows: a beam
continued by several children forks (``branch``: the children share the parent's memory; the
manager copies the shared partial unit when a child first writes it), a beam nobody continues
ends (``prune``: its memory is freed). The group's rules:

- it samples together: a member's decode runs only in a step where every live member decodes
  (none waiting, none part-way through a recompute); a member recomputing after a preemption
  computes up to its last token and waits there for the others (``_ready_groups``);
- it is preempted as one: the victim is the group at the tail of ``running`` (members stay
  contiguous there: admitted together, children and late members placed after their group),
  every member swapped out (``preemption="swap"``, when the swap space holds every member's
  tokens: each stores its own copy of what they share) or every member recomputed
  (``_preempt_unit``);
- it is admitted as one: every waiting member, or none (``_admit_group``); a swapped group comes
  back whole, each member into private memory (``_swapped_unit``; its later forks share again);
  a group recomputed whole shares its history again, in whole units a fork shares: the first
  member holds what all have in common and computes it once, each other member holds what it
  shares most with an earlier one (its pair's longer history, or the common part), grows by its
  own tail, and starts computing once what it shares is computed (``_place_sharing``,
  ``_history_tree``, ``Sequence.shared_from``); with prefix sharing, private memory with each
  member's own prefix hits is tried first (``_place_private``);
- a step that scheduled nothing while only beams waiting for a sibling run preempts them, so
  the group is admitted whole next step (``_unblock_groups``).

Samples of an ``n > 1`` request are no group (each is scheduled and preempted alone), but one
admitted later (recomputed after a preemption, or forked into no room) holds a running
sibling's units of the history they share, as a fork would (``_sibling_share``, the manager's
``share_from``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .errors import OutOfCapacityError, SchedulerError, UnknownSequenceError
from .beam_fit import check_beam_group_fits, unit_costs
from .managers.base import ManagerContractError, check_hit
from .request import Sequence, SeqState


class BeamGroups:
    """Beam-group scheduling (a mixin over Scheduler: ``running``, ``waiting``, ``swapped``,
    ``seqs``, ``manager``, ``config``, ``_decoded``, ``_scheduled``, ``_unfinished_samples``,
    ``_preempt``, ``_swappable``, ``_requeue``, ``_fits``, ``_pin``, ``_unpin``,
    ``beam_pool_bytes``)."""

    def _check_beam_group_fits(self, request) -> None:
        """RequestTooLargeError when a beam request's group could never run (scheduler.beam_fit)."""
        check_beam_group_fits(request, self.manager, max_running=self.config.max_running,
                              **self.beam_pool_bytes())

    # ---- what the beam search says after a step (between schedule and update) -------------
    def branch(self, parent_id: int, count: int) -> List[int]:
        """Give running beam ``parent_id`` ``count`` more children, forked from it by the next
        ``update`` (each child's token is ``sampled[child_id]`` there, the parent's own is
        ``sampled[parent_id]``). Returns the children's seq ids."""
        parent = self._beam(parent_id)
        if parent.state is not SeqState.RUNNING or parent.pending_forks:
            raise SchedulerError(f"sequence {parent_id} is {parent.state.value} with "
                                 f"{len(parent.pending_forks)} pending forks; only a running "
                                 f"beam just scheduled can branch")
        ids = tuple(range(self._next_seq_id, self._next_seq_id + count))
        self._next_seq_id += count
        parent.pending_forks = ids
        self._unfinished_samples[parent.request.request_id] += count
        return list(ids)

    def prune(self, seq_ids) -> None:
        """End beams nobody continues (called before ``update``): the tokens the last plan
        computed for them are dropped and their memory is freed now; they end "finished"."""
        seqs = [self._beam(i) for i in seq_ids]
        if not seqs:
            return
        self._finish([s for s in seqs if not s.state.is_ended])
        self._drop_ended_from_step()

    def _beam(self, seq_id: int) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence id {seq_id}")
        if not seq.beam_width:
            raise SchedulerError(f"sequence {seq_id} is not a beam (its request has no beam_width)")
        return seq

    # ---- scheduling rules ----------------------------------------------------------------
    def _members(self, queue, request) -> List[Sequence]:
        return [s for s in queue if s.request is request]

    def _ready_groups(self) -> Dict[int, bool]:
        """{request id: whether every live member of its group decodes this step} for every
        group with a running member (one pass over ``running`` and ``waiting``)."""
        ready: Dict[int, bool] = {}
        for m in self.running:
            if m.beam_width:
                rid = m.request.request_id
                decodes = m.length - m.num_computed == 1 and bool(m.output)
                ready[rid] = ready.get(rid, True) and decodes
        for queue in (self.waiting, self.swapped):
            for m in queue:
                if m.beam_width and m.request.request_id in ready:
                    ready[m.request.request_id] = False
        return ready

    def _tail_unit(self) -> List[Sequence]:
        """The preemption victim: the sequence at the tail of ``running``, with its whole group
        (contiguous there) when it is a beam; in running order."""
        tail = self.running[-1]
        if not tail.beam_width:
            return [tail]
        first = len(self.running) - 1
        while first > 0 and self.running[first - 1].request is tail.request:
            first -= 1
        return self.running[first:]

    def _preempt_unit(self, victims: List[Sequence], plan, recompute: bool = False) -> None:
        """Preempt ``victims`` (``_tail_unit``: one sequence, or a beam group whole), from the
        tail: a group is swapped out only if all of it can be (no member part-way through a
        prefill or waiting, the swap space holding every member), else recomputed whole;
        ``recompute`` forces the latter."""
        swap = None                               # one sequence: _preempt decides
        if recompute:
            swap = False
        elif victims[0].beam_width:
            swap = (all(self._swappable(m) for m in victims)
                    and not self._members(self.waiting, victims[0].request)
                    and self.manager.can_swap_out_all([m.seq_id for m in victims]))
        for victim in reversed(victims):
            self._preempt(victim, plan, swap)

    def _swapped_unit(self) -> List[Sequence]:
        """The head of ``swapped`` with the rest of its beam group (contiguous there: swapped
        out together), in order."""
        head = self.swapped[0]
        if not head.beam_width:
            return [head]
        group = []
        for seq in self.swapped:
            if seq.request is not head.request:
                break
            group.append(seq)
        return group

    def _recompute_swapped(self, group: List[Sequence]) -> None:
        """Drop the swapped ``group``'s swap copies; it waits to be recomputed (admitted whole,
        or the empty cache's refusal names it)."""
        for seq in reversed(group):
            self.swapped.remove(seq)
            self._requeue(seq, 0)                 # the manager drops its swap copy

    def _run_beside(self, seq: Sequence) -> None:
        """Make ``seq`` running; a beam goes right after its group's last running member (a
        group stays contiguous in ``running``), anything else at the tail."""
        self._make_running(seq)
        if not seq.beam_width:
            return
        self.running.pop()
        last = max((i for i, s in enumerate(self.running) if s.request is seq.request),
                   default=len(self.running) - 1)
        self.running.insert(last + 1, seq)

    def _admit_group(self, head: Sequence, reserve: int) -> Optional[List[Sequence]]:
        """Admit every waiting member of ``head``'s group, or none (None: they do not all fit
        now). A group recomputed whole shares its history again (``_place_sharing``), else
        each member gets its own memory (a recompute shares nothing it has not computed)."""
        members = self._members(self.waiting, head.request)
        if len(self.running) + len(members) > self.config.max_running:
            return None
        # with prefix sharing, each beam's own cached units may cover more than the history
        # they share: those first
        history, computed = self._shared_history(members), None
        if self.config.enable_prefix_sharing or history is None:
            computed = self._place_private(members, reserve)
        if computed is None and history is not None:
            computed = self._place_sharing(members, *history, reserve)
        if computed is None:
            return None
        for m, c in zip(members, computed):
            self.waiting.remove(m)
            m.held = m.length
            m.num_computed = c
            self._run_beside(m)       # a child that did not fit joins its running siblings
        return members

    def _shared_history(self, members: List[Sequence]) -> Optional[tuple]:
        """``_history_tree`` of a group recomputed whole (none of it running) whose beams
        share any history, if only in pairs; None when they share none."""
        if self._members(self.running, members[0].request):
            return None
        shared, tree = self._history_tree(members)
        return (shared, tree) if any(tokens for _, tokens in tree) else None

    def group_floor_tokens(self, members: List[Sequence]) -> int:
        """The fewest tokens of memory a beam group's live ``members`` need to come back now:
        their common history once, and each one's history past what it shares with an
        earlier member (``_history_tree``), as the pool backs it (``_backed_tokens``)."""
        return self._floor_tokens(members, *self._history_tree(members))

    def _floor_tokens(self, members: List[Sequence], shared: int, tree: List[tuple]) -> int:
        starts = [shared] + [tokens for _, tokens in tree]
        backed = self._backed_tokens()
        return shared + sum(backed(m.length - start) for m, start in zip(members, starts))

    def _backed_tokens(self):
        """A function: the tokens of a history's tail (starting at a unit boundary) -> the
        tokens the pool's units backing it hold: whole units a fork shares, then the partial
        last unit rounded up only as far as its pages reach, by the rule the add-time check
        sizes a group with (``beam_fit.unit_costs``: a vmem group backed by its bytes holds a
        partial unit in ``member_pages_for(fill)`` pages of each member, not whole; paged and
        whole-backed units are whole). So a group's floor is what it held while it ran, never
        more: a search the add-time check accepted can come back after a preemption."""
        unit = self.manager.fork_unit_tokens
        if not unit:
            return lambda tokens: tokens
        kinds = unit_costs(self.manager)[2]

        def backed(tokens: int) -> int:
            whole, fill = divmod(tokens, unit)
            if not fill:
                return tokens
            held = [partial(fill) for _, _, partial in kinds]
            low, high = fill, unit       # the most fill the same pages back (bisected: a
            while high > low:            # partial unit's cost only grows with its fill)
                mid = (low + high + 1) // 2
                same = all(partial(mid) <= h for (_, _, partial), h in zip(kinds, held))
                low, high = (mid, high) if same else (low, mid - 1)
            return whole * unit + low
        return backed

    def _history_tree(self, members: List[Sequence]) -> tuple:
        """(the tokens all ``members`` have in common, and for each member after the first:
        (index of the earlier member whose history it shares most, those tokens), at least
        the common ones, which the first member holds). Beams that diverged late in pairs
        share their pair's history, not only the group's trunk: in any order this holds each
        unit of their histories' tree once."""
        shared, tree = self._common_history_tokens(members), []
        for j, m in enumerate(members[1:], 1):
            best = (0, shared)
            for i in range(j):
                tokens = self._common_history_tokens([members[i], m])
                if tokens > best[1]:
                    best = (i, tokens)
            tree.append(best)
        return shared, tree

    def _common_history_tokens(self, members: List[Sequence]) -> int:
        """Tokens every member starts with (the prompt and the outputs they all share), in
        whole units a fork shares, below each one's last token; 0 where nothing can be shared
        (one member, a manager whose forks copy)."""
        unit, request = self.manager.fork_unit_tokens, members[0].request
        if len(members) < 2 or not unit:
            return 0
        common = 0
        for column in zip(*(m.output for m in members)):
            if any(t != column[0] for t in column):
                break
            common += 1
        tokens = min(request.prompt_len + common, min(m.length for m in members) - 1)
        return tokens // unit * unit

    def _place_private(self, members: List[Sequence], reserve: int) -> Optional[List[int]]:
        """Allocate each member its own memory: the tokens each may skip (its prefix hits, or
        a member joining running siblings, a child forked into no room: the units of the
        history it shares with one, held once, ``_sibling_share``), or None and nothing held
        when they do not all fit."""
        mgr, share = self.manager, self.config.enable_prefix_sharing
        scope, final = members[0].request.prefix_scope, members[0].request.max_total_len
        hits = []
        for m in members:
            ids = m.token_ids() if share else None
            # a running sibling's units even with prefix sharing: one swapped back in holds
            # its history unpublished, where the prefix cache finds none of it
            sibling = self._sibling_share(m)
            if not self._fits(m, ids, reserve, sibling):   # (its adapter, pinned per member)
                self._release_placed(members[:len(hits)])
                return None
            self._pin(m)
            hits.append(mgr.allocate(m.seq_id, m.length, ids, scope, final_tokens=final,
                                     **sibling))
            try:   # a user's manager may return any hit: one it could not have is refused
                check_hit(mgr, hits[-1], m.length, ids, share_from=sibling.get("share_from"))
            except ManagerContractError:
                self._release_placed(members[:len(hits)])
                raise
        return [min(hit, m.length - 1) for m, hit in zip(members, hits)]

    def _release_placed(self, placed: List[Sequence]) -> None:
        for m in placed:
            self.manager.free(m.seq_id, computed_tokens=0)
            self._unpin(m)

    def _place_sharing(self, members: List[Sequence], shared: int, tree: List[tuple],
                       reserve: int) -> Optional[List[int]]:
        """A group preempted out of shared memory comes back sharing its history again: the
        leader (``members[0]``) holds the first ``shared`` tokens (all members' common
        history) and computes them once; a member sharing only those is forked from it, one
        sharing more with an earlier member (``tree``, ``_history_tree``) holds that member's
        units of them; each grows by its own tail and starts after what it shares is computed
        (``Sequence.shared_from``). The tokens each may skip, or None and nothing held when
        the group does not fit with ``reserve`` tokens to spare."""
        mgr, share = self.manager, self.config.enable_prefix_sharing
        leader, request = members[0], members[0].request
        ids = [m.token_ids() if share else None for m in members]
        tails = self._floor_tokens(members, shared, tree) - shared   # each one's, as backed
        adapter = {} if request.adapter is None else {"adapter": request.adapter}
        if not mgr.can_allocate(shared, ids[0] and ids[0][:shared], request.prefix_scope,
                                reserve + tails, final_tokens=request.max_total_len, **adapter):
            return None
        trunk = [(m, i) for m, i, (_, tokens) in zip(members[1:], ids[1:], tree)
                 if tokens == shared]
        pinned, placed = [], []
        try:
            for m in members:
                self._pin(m)
                pinned.append(m)
            first = shared or leader.length     # nothing all share: the leader's own
            hit = mgr.allocate(leader.seq_id, first, ids[0] and ids[0][:first],
                               request.prefix_scope, final_tokens=request.max_total_len)
            placed.append(leader)
            check_hit(mgr, hit, first, ids[0] and ids[0][:first])
            for m, i in trunk:
                if shared:
                    mgr.fork(leader.seq_id, m.seq_id)
                else:
                    mgr.allocate(m.seq_id, m.length, i, request.prefix_scope,
                                 final_tokens=request.max_total_len)
                placed.append(m)
            if shared:
                for m, i in [(leader, ids[0])] + trunk:
                    mgr.append(m.seq_id, m.length - shared, i and i[shared:])
            for m, i, (parent, tokens) in zip(members[1:], ids[1:], tree):
                if tokens > shared:      # after its parent (earlier) holds its own units
                    mgr.allocate(m.seq_id, m.length, i, request.prefix_scope,
                                 final_tokens=request.max_total_len,
                                 share_from=(members[parent].seq_id, tokens))
                    placed.append(m)
        except (OutOfCapacityError, ManagerContractError) as error:   # OutOfCapacity: rounding
            for m in reversed(placed):                                 # the estimate did not see
                mgr.free(m.seq_id, computed_tokens=0)
            for m in pinned:
                self._unpin(m)
            if isinstance(error, ManagerContractError):
                raise
            return None
        for m, (parent, tokens) in zip(members[1:], tree):
            m.shared_from = (members[parent], tokens)
        return [min(hit, leader.length - 1)] + [0] * (len(members) - 1)

    def _adopt_shared(self, seq: Sequence) -> bool:
        """Whether ``seq``, sharing an earlier member's first tokens (``_place_sharing``), may
        compute now: once that member has computed them, they count as computed for it too."""
        leader, shared = seq.shared_from
        if leader.num_computed < shared:
            return False
        seq.shared_from, seq.num_computed = None, shared
        return True

    # ---- samples of one request (n > 1) ---------------------------------------------------
    def _sibling_share(self, seq: Sequence) -> dict:
        """A sample admitted late (recomputed, or forked into no room) holds a running sibling's
        units of the history they share (the prompt and their common outputs, computed by it,
        whole units a fork shares) rather than a copy of them: ``{"share_from": (sibling,
        tokens)}`` for the manager, the sibling sharing most; {} where none is (with prefix
        sharing the prefix cache finds them)."""
        unit, best = self.manager.fork_unit_tokens, (None, 0)
        if not unit or not seq.output:
            return {}
        for other in self._members(self.running, seq.request):
            tokens = min(self._common_history_tokens([seq, other]),
                         other.num_computed // unit * unit)
            if tokens > best[1]:
                best = (other.seq_id, tokens)
        return {} if best[0] is None else {"share_from": best}

    def _unblock_groups(self, plan) -> None:
        """Nothing was scheduled, yet sequences run: beam members waiting for a sibling that
        cannot be admitted, and any others (swapped in or part-way through a prefill) that got
        no room, which those members hold. Preempt from the tail while such a group runs (a
        group by recompute, a sequence as ``_preempt`` decides), so the group is admitted whole,
        or the empty cache's refusal names it, next step, and the others grow (they were failed
        "no room to grow" in a cache that held them alone). Not a group admitted whole this
        step whose every member decodes next (a recompute its prefix hits covered up to the
        last token): preempting it would admit it the same way again, for ever."""
        if plan.seqs or not self.running:
            return
        while self.running and not all(self._ready_groups().values()):
            unit = self._tail_unit()   # (a group swapped would bring back the part that fits)
            self._preempt_unit(unit, plan, recompute=bool(unit[0].beam_width))

