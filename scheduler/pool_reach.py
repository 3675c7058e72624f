"""How large a scheduler's pool is and how far it can grow (a mixin over Scheduler): the
capacity figures submission checks (``_refresh_capacity``), ``resize``, a MemoryBudget's reach
(``use_budget``: the share's max, less the other shares' minimums) and the verdict on a sequence
that cannot fit even with the pool grown as far as it can (``_never_fits``).

A model whose windowed kinds give back what lies behind the window (paged block groups, vmem
kinds) holds less than its whole length: ``fit_tokens`` counts, per kind, what it holds at each
length (``beam_fit.sequence_need``), so how long a sequence may grow depends on its prompt."""
from __future__ import annotations

from typing import Tuple

from .adapters import adapter_fit_tokens
from .beam_fit import beam_fit_tokens, longest_sequence, unit_costs
from .errors import RequestTooLargeError
from .lifecycle import resize_pool
from .managers.base import check_stats
from .request import Sequence


class PoolReach:
    """Mixed into Scheduler (its ``manager``, ``config``, ``growable``, ``budget_share``,
    ``max_fit_tokens``, ``max_fit_bytes``)."""

    def use_budget(self, share) -> None:
        """A MemoryBudget ``share`` resizes the pool step by step: admission waits for it to
        grow, up to ``reach_bytes`` (None: no budget, the pool stays as it is sized)."""
        self.growable, self.budget_share = share is not None, share

    def _init_reach(self) -> None:
        """The per-kind costs of one sequence where a kind gives back behind its window (None
        where none does: every kind holds a sequence's whole length)."""
        unit, self._window_costs = self.manager.fork_unit_tokens, None
        if unit and self.manager.window_tokens:
            self._window_costs = unit_costs(self.manager)[2]

    def fit_tokens(self, prompt_tokens: int, whole: bool = False) -> Tuple[int, int]:
        """The longest sequence of a ``prompt_tokens`` prompt the pool holds alone: as it is
        (``max_fit_tokens``'s pool) and grown as far as it can (``max_fit_tokens_at_max``'s).
        A pool a MemoryBudget resizes (``growable``) grows on demand: both are its reach's.
        Never below those full-length figures; past them where windows give memory back
        (not ``whole``: the whole length in every layer, as a beam group's is counted)."""
        most = self.longest_at(prompt_tokens, self.reach_bytes, self.max_fit_tokens_at_max, whole)
        if self.growable:
            return most, most
        return self.longest_at(prompt_tokens, self.max_fit_bytes, self.max_fit_tokens, whole), most

    def longest_at(self, prompt_tokens: int, cache_bytes: int, full_tokens: int,
                   whole: bool = False) -> int:
        """The longest sequence of a ``prompt_tokens`` prompt a pool of ``cache_bytes`` holds
        alone: ``full_tokens`` (its whole length in every layer), or past it where windows give
        memory back (unless ``whole``)."""
        if self._window_costs is None or whole:
            return full_tokens
        unit, limit = self.manager.fork_unit_tokens, self.manager.max_seq_len
        return max(full_tokens, longest_sequence(prompt_tokens, self.manager.pool_units(
            cache_bytes), unit, self._window_costs, limit))

    def ever_fit_tokens(self, prompt_tokens: int, whole: bool = False) -> Tuple[int, int]:
        """(Whole in every layer, of a ``prompt_tokens`` prompt as ``fit_tokens`` counts it) the
        longest sequence the pool could ever hold: ``max_fit_tokens_at_max``'s pool, on a
        MemoryBudget its reach with no other share's minimum beside it (``most_bytes``). Past
        it a request can never fit."""
        if not self.growable:
            return self.max_fit_tokens_at_max, self.fit_tokens(prompt_tokens, whole)[1]
        full = self.manager.max_sequence_tokens_at(self.most_bytes)
        return full, self.longest_at(prompt_tokens, self.most_bytes, full, whole)

    def beam_fit_tokens(self, prompt_tokens: int, beam_width: int,
                        runs_to_max_tokens: bool) -> int:
        """The most prompt + max_tokens ``add_request`` accepts for a search of ``beam_width``
        beams over a ``prompt_tokens`` prompt (``runs_to_max_tokens``: no stop id can end it):
        every beam at full length (``max_fit_tokens_at_max``, ``max_seq_len``), and the group's
        least held within the pool (``beam_fit.check_beam_group_fits``). One that fits only the
        pool resized back up (CacheShrunkError) counts."""
        limit = min(x for x in (self.max_seq_len, self.max_fit_tokens_at_max) if x)
        return beam_fit_tokens(prompt_tokens, beam_width, runs_to_max_tokens, self.manager,
                               limit, **self.beam_pool_bytes())

    def beam_pool_bytes(self) -> dict:
        """The pool sizes a beam group is checked at (``check_beam_group_fits``' keywords):
        a MemoryBudget's reach, and asleep the size kept from before sleep."""
        return dict(reach_bytes=self.reach_bytes if self.growable else None,
                    wake_bytes=self.max_fit_bytes)

    def window_step_end(self, seq: Sequence) -> int:
        """The furthest a prefill chunk of ``seq`` growing past what it holds may end holding
        no more than a decode at that length holds: the window released before the chunk reads
        from one unit earlier, so the chunk stops before any kind's first unit read moves."""
        c, unit = seq.num_computed, self.manager.fork_unit_tokens
        return min(w - 1 + (max(0, c - w + 1) // unit + 1) * unit
                   for w, _, _ in self._window_costs if w)

    def _refresh_capacity(self) -> None:
        stats = self.manager.stats()
        check_stats(self.manager, stats)   # a policy's None: named, not an AttributeError here
        self.total_tokens = total = stats.total_tokens
        # the longest sequence the manager could ever hold (a reservation may need more than the
        # tokens it caches) and the pool's size, checked at submission; a pool a MemoryBudget
        # resizes (``growable``) keeps the most it has held, which it grows back to on demand
        fit, held = self.manager.max_sequence_tokens, self.manager.cache_bytes
        if self.growable:
            fit, held = max(fit, self.max_fit_tokens), max(held, self.max_fit_bytes)
        self.max_fit_tokens, self.max_fit_bytes = fit, held
        self.watermark_tokens = int(self.config.watermark * total)

    @property
    def max_fit_tokens_at_max(self) -> int:
        """The longest sequence the pool could hold grown as far as it can: resized up to
        ``max_cache_bytes``, or where a MemoryBudget resizes it (``growable``, on demand) to
        its reach (``reach_bytes``), which the others' minimums may hold below its max."""
        if self.growable:
            return self.manager.max_sequence_tokens_at(self.reach_bytes)
        return max(self.max_fit_tokens, self.manager.max_sequence_tokens_at_max)

    def resize(self, cache_bytes: int, preempt: bool = False, check_fit: bool = True,
               partial: bool = False):
        """Set the manager's pool to ``cache_bytes`` (vmem only) and return the plan that does
        it: grown at once; shrunk by giving back free, then unused, then cached pages, then
        (``preempt``) preempting running sequences from the tail. CacheResizeError when it
        cannot (bytes still held, unless ``partial``: then it shrinks as far as it can; or,
        ``check_fit``, a live request that would no longer fit): call it inside a transaction
        (``begin``, and the manager's) to undo that."""
        return resize_pool(self, cache_bytes, preempt, check_fit, partial)

    @property
    def reach_bytes(self) -> int:
        """The most the pool can grow to now: its max, and on a budget what the other shares'
        minimums leave (a share's max defaults to the whole budget)."""
        limit = self.manager.max_cache_bytes
        return limit if self.budget_share is None else \
            min(limit, self.budget_share.reachable_bytes)

    @property
    def most_bytes(self) -> int:
        """The most the pool may ever grow to: its max, and on a budget its share's max and the
        budget's total (its reach with no other share's minimum beside it; a max_cache_bytes
        past the total said a request the budget can never hold would fit at the max)."""
        limit, share = self.manager.max_cache_bytes, self.budget_share
        return limit if share is None else min(limit, share.max_bytes, share.budget.total_bytes)

    def reach_note(self, most_tokens: int) -> str:
        """How far a pool a MemoryBudget resizes can grow now, in words: its reach (the budget
        less the other shares' minimums) and its share's max, where it would hold
        ``most_tokens`` (of the sequence a message is about)."""
        return (f"grown to the {self.reach_bytes} bytes its MemoryBudget share can reach now "
                f"(the budget's {self.budget_share.budget.total_bytes} less the other shares' "
                f"minimums; at its max, {self.most_bytes} bytes, it would hold {most_tokens})")

    def _cannot_grow(self) -> bool:
        """The pool is as large as it can grow (fixed, or a budget's at its reach)."""
        return not self.growable or \
            self.manager.cache_bytes + self.manager.resize_step_bytes > self.reach_bytes

    def _never_fits(self, seq: Sequence, what: str) -> None:
        """RequestTooLargeError naming ``seq``'s request, which ``what`` with nothing else
        running and the pool as large as it can grow (``_cannot_grow``): the next step would
        be the same. A beam member's message names its group (its beams run together, each
        holding its own unit). A group that cannot grow alone because it was swapped back in
        (each beam its own copy of the history) is not failed so: ``_grow`` first recomputes
        it once, sharing that history again, and fails it only if it still cannot grow."""
        group = (f", one of the {seq.request.beam_width} beams of a beam search, which hold a "
                 f"unit each and run together" if seq.beam_width else "")
        ref = seq.request.adapter
        beside = "" if ref is None else f" beside adapter {ref}"
        bound = "" if not self.growable else " (its max)" if \
            self.reach_bytes >= self.most_bytes else \
            f" {self.reach_note(self._sequence_tokens(seq, self.most_bytes))}"   # its reach
        raise RequestTooLargeError(
            f"sequence {seq.seq_id} ({seq.length} tokens{group}) {what} of "
            f"{self._sequence_tokens(seq)} tokens of one sequence{beside}{bound} under policy "
            f"{self.manager.name!r}", request_id=seq.request.request_id)

    def _sequence_tokens(self, seq: Sequence, cache_bytes=None) -> int:
        """The longest sequence the pool holds whole, as it is or resized to ``cache_bytes``
        (None); with ``seq``'s adapter, whose pages are not the sequence's, what it holds beside
        it (``adapter_fit_tokens``, as its request was checked)."""
        ref = seq.request.adapter
        if ref is not None:
            return adapter_fit_tokens(seq.request.prompt_len, ref, self.manager, cache_bytes)
        return self.manager.pool_sequence_tokens if cache_bytes is None else \
            self.manager.max_sequence_tokens_at(cache_bytes)
