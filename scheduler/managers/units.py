"""UnitOps: what the paged and vmem managers share -- fixed-size, shareable units of tokens.

A unit is a paged block or a vmem page group: ``unit_tokens`` tokens, a reference count, and,
once full and computed, a verified chain digest under which later sequences can find and share
it (prefix.py).
Managers say how units are taken, held and released; this mixin owns the arithmetic of how
many units a request needs, prefix matching and its counters, and copy-on-write accounting.
Both managers mix it in beside ``ManagerCore`` (each two levels below ``MemoryManager``).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Optional, Sequence

from ..errors import ConfigError, RequestTooLargeError
from .common import ManagerCore
from .eviction import make_eviction
from .journal import JList
from .prefix import ChainedPrefixIndex, HeldSeq, namespace_root, token_bytes, unit_keys
from .unpublish import Unpublishing
from .window import WindowSwapError, dropped_units


class UnitOps(Unpublishing):
    """Mixed into managers whose memory is ``num_units`` units of ``unit_tokens`` tokens.
    ``prefix_queries``/``prefix_hits`` count TOKENS, as vLLM's prefix-cache metrics do."""

    _plain_append = True   # False: appends go to _append_other (paged hybrid; byte-backed vmem)

    def _init_units(self, num_units: int, unit_tokens: int, eviction: str,
                    free_list: bool = True) -> None:
        self.unit_tokens = self.prefix_unit_tokens = self.fork_unit_tokens = unit_tokens
        self.prefix_eviction = eviction
        cell = self._cell
        self._refs = [0] * num_units                 # holders of each unit   } plain lists,
        self._fill = [0] * num_units                 # tokens in each unit    } see _touch
        self.prefix = ChainedPrefixIndex(cell)      # none outlives its parent (hits: from unit 0)
        self._live = self._cap_sum = self._tok_sum = 0
        self._memo = (None, None, [])                # last (namespace, token ids, their keys)
        if free_list:      # (paged keeps its free blocks in a PageLedger instead)
            self._free = JList(cell, range(num_units - 1, -1, -1))   # unheld, nothing kept
        self._cache = make_eviction(eviction, cell)  # cached: unheld, registered (computed) units
        # _live: tokens in held units (a shared unit counted once); _cap_sum / _tok_sum: over
        # resident sequences, len(units) * unit_tokens and num_tokens

    _FIXED_FIELDS = ManagerCore._FIXED_FIELDS | {"unit_tokens", "prefix_unit_tokens",
                                                 "fork_unit_tokens", "prefix_eviction"}
    _SAVED_FIELDS = ManagerCore._SAVED_FIELDS + ("_live", "_cap_sum", "_tok_sum", "_memo")
    _LOGGED_FIELDS = ManagerCore._LOGGED_FIELDS | {"_refs", "_fill"}
    _JOURNALED_FIELDS = ManagerCore._JOURNALED_FIELDS | {"prefix", "_free", "_cache"}

    def _unit_arrays(self) -> tuple:
        return self._refs, self._fill

    def _touch(self, unit: int) -> None:
        """Call before writing ``_refs[unit]`` or ``_fill[unit]``: inside a transaction the
        pair is saved at its first write (plain lists keep the hot paths at list speed)."""
        cell = self._cell
        if cell.active:       # (outside one, no call: the simulator's per-block path)
            cell.save_unit(unit, self._refs, self._fill)

    @property
    def cached_tokens(self) -> int:
        """Computed tokens of cached units, findable, held by nobody (admission may evict them),
        each once: the policy's O(1) sum of ``_retained`` (a paged hybrid's: NodeCountedCache)."""
        return self._cache.tokens

    def cached_units(self) -> list:
        """The cached units, first to be evicted first."""
        return list(self._cache)

    def _hold(self, unit: int) -> None:
        """One more holder of an existing (hit or shared) unit; an unheld one leaves the cache
        (or, vmem, the groups still mapped under a freed slot)."""
        self._touch(unit)
        if self._refs[unit] == 0:
            self._revive(unit)
            self._live += self._fill[unit]
        self._refs[unit] += 1

    def _revive(self, unit: int) -> None:
        self._cache.remove(unit)      # nobody held it: held again, out of the cache

    def _unhold(self, unit: int) -> None:
        """One holder fewer; the last one leaves the unit cached (registered, retention on) or
        gives it up (``_drop_content``)."""
        self._touch(unit)
        self._refs[unit] -= 1
        if self._refs[unit] == 0:
            self._live -= self._fill[unit]
            kept_tokens = self._retained(unit)
            if kept_tokens and self._cache.retains:
                self._cache.add(unit, kept_tokens)
            else:
                self.prefix.drop(unit)
                self._cache.forget(unit)
                self._unheld(unit)

    def _retained(self, unit: int) -> int:
        """Computed, findable tokens an unheld ``unit`` keeps cached (registered: all; 0: none)."""
        return self.unit_tokens if unit in self.prefix.by_unit else 0

    @abstractmethod
    def _unheld(self, unit: int) -> None:
        """``unit`` (refs 0, no content kept) goes where the layout keeps such units."""

    def _evict(self) -> int:
        """Drop the cached unit the policy names, and those chained below it; returns it."""
        unit = self._cache.pop()        # (below it, unreachable: given back, drop_cached_chain)
        self._drop_findable(unit)
        return unit

    def reset_prefix_cache(self) -> int:
        """Evict every cached unit (vLLM's reset_prefix_cache); held units keep their content (and
        registrations, but those below an evicted one). Returns the units evicted. With nothing
        held, memory is back at its baseline (none cached; vmem: free or still-mapped groups)."""
        evicted = len(self._cache)
        while self._cache:          # (an eviction may give back units chained below it too)
            unit = self._evict()
            self._cache.forget(unit)
            self._unheld(unit)
        return evicted

    # -- publish on compute --
    def mark_computed(self, seq_id: int, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens of ``seq_id`` have K/V written: its full units among
        them become findable by later prefix queries (nothing is published before)."""
        self._publish(self._changing(seq_id), num_tokens)

    def _republish(self, seq: HeldSeq) -> None:
        """A swapped-in sequence's content is back in new units: findable again."""
        published, seq.published = seq.published, 0
        self._publish(seq, published * self.unit_tokens)

    def _publish(self, seq: HeldSeq, computed_tokens: int) -> None:
        upto = min(computed_tokens // self.unit_tokens, len(seq.keys), len(seq.units))
        for k in range(seq.published, upto):
            self._register_unit(seq.units, seq.keys, k)
            if k >= seq.prompt_units:
                self._cache.note_generated(seq.units[k])
        seq.published = max(seq.published, upto)

    # -- admission --
    def _can_place(self) -> bool:
        """Room for one more sequence besides units (vmem: a free slot)."""
        return True

    def _hits(self, num_tokens: int, token_ids, namespace, share_from=None) -> list:
        """Units already holding this prompt's leading full units (verified, see prefix.py),
        or ``share_from``'s (``_sibling_hits``). Only units inside the first ``num_tokens - 1``
        tokens are eligible, so a hit never covers the last token: the caller always computes
        at least one token (whose logits it needs) and never writes into a shared unit."""
        if share_from is not None or token_ids is None:
            return [] if share_from is None else self._sibling_hits(num_tokens, *share_from)
        limit = min(num_tokens - 1, len(token_ids)) // self.unit_tokens
        return self.prefix.match(self._prompt_keys(token_ids, namespace)[:max(limit, 0)])

    def _sibling_hits(self, num_tokens: int, sibling_id: int, tokens: int) -> list:
        """Resident ``sibling_id``'s units of its first ``tokens`` (below ``num_tokens``; the
        caller knows their K/V are written and this sequence's); [] if one was given back."""
        units = self._seq(sibling_id).units[:min(tokens, num_tokens - 1) // self.unit_tokens]
        return units if all(self._shareable(u) for u in units) else []

    def _prompt_keys(self, token_ids, namespace) -> list:
        """Keys of every full unit of ``token_ids`` (ConfigError for an id outside int64 or a
        namespace that is not a str).
        can_allocate then allocate key the same prompt, so the last one is memoised, keyed on
        its content and namespace (never on the list's identity)."""
        if namespace is not None and not isinstance(namespace, str):
            raise ConfigError(f"namespace must be a str or None, got {namespace!r}")
        ids = list(token_ids)
        memo = self._memo
        if memo[0] != namespace or memo[1] != ids:
            root = namespace_root(namespace, self.model.kv_encoding)
            keys = unit_keys(token_bytes(ids), self.unit_tokens, root)
            memo = self._memo = (namespace, ids, keys)
        return memo[2]

    def _need(self, num_tokens: int, hits: list) -> int:
        """Units a new sequence takes from the free + reclaimable pool (a hit unit nobody holds
        any more is revived from that pool, so it still counts)."""
        revived = sum(1 for u in hits if self._refs[u] == 0)
        return -(-num_tokens // self.unit_tokens) - len(hits) + revived

    def can_allocate(self, num_tokens: int, token_ids: Optional[Sequence[int]] = None,
                     namespace: Optional[str] = None, reserve_tokens: int = 0,
                     final_tokens: Optional[int] = None, adapter=None, share_from=None,
                     lookup: bool = True) -> bool:
        if num_tokens > self.max_sequence_tokens or not self._can_place():
            return False
        cost = self._adapter_admission_cost(adapter)
        if cost is None:
            return False
        hits = self._hits(num_tokens, token_ids if lookup else None, namespace, share_from)
        spare = self._available_units() - cost - self._need(num_tokens, hits)
        return spare >= 0 and self._units_as_tokens(spare) >= reserve_tokens

    def _units_as_tokens(self, units: int) -> int:
        """Tokens that ``units`` of what ``_available_units`` counts hold (vmem: pages)."""
        return units * self.unit_tokens

    def _count_prefix(self, token_ids, num_tokens: int, hits: list) -> int:
        """Record a prefix query; returns the hit tokens."""
        hit_tokens = len(hits) * self.unit_tokens
        if token_ids is not None:
            self.prefix_queries += num_tokens
            self.prefix_hits += hit_tokens
        return hit_tokens

    def _register_prompt(self, seq: HeldSeq, hits: list) -> None:
        """At allocate: key the new sequence's full units (the keys ``_hits`` just computed);
        the hits are published already, the rest wait for ``mark_computed``."""
        if seq.ids is not None:
            full = min(seq.num_tokens, len(seq.ids)) // self.unit_tokens
            seq.keys = self._prompt_keys(seq.ids, seq.namespace)[:full]
        seq.published, seq.prompt_units = len(hits), len(seq.keys)
        # no new unit: forgets the ids if a full unit has none
        seq.new_full_keys(self.unit_tokens, self.model.kv_encoding)
        for unit in hits:
            self._cache.note_hit(unit)

    def _register_unit(self, units: list, keys: list, k: int) -> None:
        """Name unit ``k`` of a sequence's ``units`` by ``keys[k]`` in the index, chained on its
        unit k-1, or, when another unit holds that content (computed by two sequences at
        once), on that one: the rest of the sequence stays findable behind the first copy.
        Nothing when unit k or k-1 was given back behind a window (gone, or a chain that
        cannot be verified)."""
        if not self._shareable(units[k]) or (k and units[k - 1] is None):
            return
        index, parent = self.prefix, units[k - 1] if k else None
        if k and parent not in index.by_unit:
            chain = index.match(keys[:k])     # rare: a duplicate unit k-1
            if len(chain) < k:
                return
            parent = chain[-1]
        index.register(units[k], keys[k], parent)

    def _shareable(self, unit: Optional[int]) -> bool:
        """Whether ``unit`` still holds its content for every layer (None: given back)."""
        return unit is not None

    def _publish_at_free(self, seq: HeldSeq, computed_tokens) -> None:
        """At free: publish what was computed (``computed_tokens``; None: everything held)."""
        self._publish(seq, seq.num_tokens if computed_tokens is None else computed_tokens)

    # -- growth --
    def append(self, seq_id: int, num_tokens: int = 1,
               token_ids: Optional[Sequence[int]] = None) -> None:
        seq = self._seq(seq_id)
        new = seq.num_tokens + num_tokens
        if (self._plain_append and not self._cell.active
                and new <= len(seq.units) * self.unit_tokens
                and new <= self.max_seq_len and num_tokens > 0 and seq.ids is None
                and token_ids is None and self._refs[seq.units[-1]] == 1):
            # hot path: room in a private last unit, no ids to hash, no transaction: counters
            self._fill[seq.units[-1]] += num_tokens
            self._live += num_tokens
            self._tok_sum += num_tokens
            seq.num_tokens = new
            return
        if self._plain_append:
            self._append_logged(seq_id, seq, num_tokens, token_ids)
        else:
            self._append_other(seq_id, seq, num_tokens, token_ids)

    def _append_other(self, seq_id: int, seq: HeldSeq, num_tokens: int, token_ids) -> None:
        """``append`` where ``_plain_append`` is False (the manager's own rule)."""
        self._append_logged(seq_id, seq, num_tokens, token_ids)

    def _append_logged(self, seq_id: int, seq: HeldSeq, num_tokens: int, token_ids) -> None:
        """``append`` past the hot path, or inside a transaction (saving what it changes)."""
        cell = self._cell
        if not cell.active:
            self._append_slow(seq_id, seq, num_tokens, token_ids)
            return
        new = seq.num_tokens + num_tokens
        if (new <= len(seq.units) * self.unit_tokens and new <= self.max_seq_len and num_tokens > 0
                and seq.ids is None and token_ids is None and self._refs[seq.units[-1]] == 1):
            cell.record_tokens(seq)       # the hot path's changes, logged
            self._append_in_place(seq, num_tokens)
            return
        cell.record(seq)
        self._append_slow(seq_id, seq, num_tokens, token_ids)

    def _append_in_place(self, seq: HeldSeq, num_tokens: int) -> None:
        """Grow ``seq`` inside its private last unit: counters only (saved by ``_touch``)."""
        self._touch(seq.units[-1])
        self._fill[seq.units[-1]] += num_tokens
        self._live += num_tokens
        self._tok_sum += num_tokens
        seq.num_tokens += num_tokens

    def _append_slow(self, seq_id: int, seq: HeldSeq, num_tokens: int, token_ids) -> None:
        """Growth that takes units, copies on write or registers prefix keys: checked first
        (state unchanged on a refusal), then the manager's ``_grow``, then ids and keys."""
        self._check_append_ids(num_tokens, token_ids)
        old, end, ut = seq.num_tokens, seq.num_tokens + num_tokens, self.unit_tokens
        if end > self.max_seq_len:
            raise RequestTooLargeError(f"sequence {seq_id} would grow to {end} tokens, over "
                                       f"max_seq_len {self.max_seq_len}")
        need = self._growth(seq, num_tokens)
        if need > self._available_units():
            self._raise_no_room(f"appending {num_tokens} tokens to sequence {seq_id} needs "
                                f"{self._units_text(need)}")
        if num_tokens == 0:
            return
        self._grow(seq_id, seq, old, end)
        seq.num_tokens = end
        seq.note_ids(old, token_ids)
        if end // ut > old // ut:
            seq.new_full_keys(ut, self.model.kv_encoding)

    @abstractmethod
    def _grow(self, seq_id: int, seq: HeldSeq, old: int, end: int) -> None:
        """Hold and account tokens [old, end) of ``seq`` (room was checked): copy a shared
        partial last unit for its writer, take new units, fill them."""

    @abstractmethod
    def _units_text(self, units: int) -> str:
        """``units`` in the words of this manager's memory, for errors."""

    def _fill_units(self, units: list, start: int, end: int) -> None:
        """Account tokens [start, end) as written into ``units`` (a table in token order)."""
        ut, pos = self.unit_tokens, start
        while pos < end:
            k = pos // ut
            stop = min(end, (k + 1) * ut)
            self._touch(units[k])
            self._fill[units[k]] += stop - pos
            pos = stop

    def _growth(self, seq: HeldSeq, num_tokens: int) -> int:
        """Units ``append(num_tokens)`` takes: new units, plus one to copy-on-write a shared
        partial last unit."""
        n, ut = seq.num_tokens, self.unit_tokens
        need = -(-(n + num_tokens) // ut) - len(seq.units)
        if n % ut and num_tokens and self._refs[seq.units[-1]] > 1:
            need += 1
        return need

    # -- sliding window (window.py): units wholly behind it given back; each manager says how
    #    a unit is given back (``_give_back``) --
    _window: Optional[int] = None

    def _init_window(self, window_tokens: Optional[int]) -> None:
        self._window = window_tokens

    @property
    def window_tokens(self) -> Optional[int]:
        return self._window

    def release_behind_window(self, seq_id: int, computed_tokens: int) -> None:
        """Unhold and unmap the sequence's groups wholly before ``computed_tokens - W + 1``."""
        if self._window is None:
            return
        seq = self._changing(seq_id)
        for units, window in self._windowed_tables(seq):
            first_read = computed_tokens - window + 1
            # the last unit always stays: growth and copy-on-write work on it
            behind = min(max(first_read, 0) // self.unit_tokens, len(units) - 1)
            first = behind             # dropped units are a prefix: walk back to its end only,
            while first > 0 and units[first - 1] is not None:   # O(units newly dropped)
                first -= 1
            for pi in range(first, behind):
                self._drop_unit(seq, units, pi)

    def _windowed_tables(self, seq: HeldSeq) -> tuple:
        """(units, window tokens) of every table of ``seq`` that gives back behind a window:
        its one unit list here; a paged hybrid's windowed block groups (paged.py)."""
        return ((seq.units, self._window),)

    def _drop_unit(self, seq: HeldSeq, units: list, pi: int) -> None:
        unit = units[pi]
        units[pi] = None
        self._unhold(unit)
        self._cap_sum -= self.unit_tokens
        self._tok_sum -= self.unit_tokens      # a unit behind the window is full
        self._give_back(seq, pi, unit)

    def _give_back(self, seq: HeldSeq, pi: int, unit: int) -> None:
        """After ``unit`` (index ``pi`` of ``seq``) is unheld: the manager's own release."""

    def _window_dropped(self, seq: HeldSeq) -> int:
        """Leading units whose memory (or, hybrid, windowed part) ``seq`` gave back."""
        return dropped_units(seq)

    def can_swap_out(self, seq_id: int) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is not None and self._window_dropped(seq):
            return False
        return super().can_swap_out(seq_id)

    def swap_out(self, seq_id: int) -> int:
        seq = self._seq(seq_id)
        if self._window_dropped(seq):
            raise WindowSwapError(
                f"sequence {seq_id} gave back {self._window_dropped(seq)} page groups behind its "
                f"{self._window}-token window and cannot be swapped out; preempt it by recompute")
        return super().swap_out(seq_id)
