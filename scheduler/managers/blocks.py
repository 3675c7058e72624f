"""Block-granular prefix hits on vmem: every computed ``block_tokens``-token block of a page group,
findable whatever the page size (issue 28).

The page-level index (prefix.py) only names FULL page groups: on 2 MiB pages a Llama-3-8B
per-layer group holds 1,024 tokens, longer than most shared prefixes. This index names the
leading blocks of a group's page: block b of the group at page index p of a sequence is keyed by

    H(parent | ids[p*T : p*T + (b+1)*B])       parent = the digest of page p-1 (prefix.py's
                                                 chain), or the namespace root for p = 0

(T tokens a page, B a block), so equal digests name equal whole prefixes up to that block. A
prompt reaches page p's blocks only through whole-page hits on pages 0..p-1, so an entry of a
page p > 0 is chained on the registration of digest(p-1) (prefix.py): it goes when that
registration goes (``drop_chained_on``, from ``drop_cached_chain``), as the registrations below
it do, and a group's last holder drops one published while no registration held its parent
(``drop_orphaned``). So a cached group's blocks are blocks some prompt can hit. A
hit copies those tokens from the group into the new sequence's own page (``CopyExtent`` with
``num_tokens``): shared pages are never written by a sequence that does not own all their
tokens. An entry keeps the parent digest and the ids it was built from, and a match checks
both: a colliding digest is a miss, never a hit. Several groups may hold one block (a copy's
destination holds what its source held); each is indexed.

Which groups carry entries is the manager's rule (vmem.py): held ones, cached ones and
reclaimable ones (unheld, still mapped, content kept); an entry goes when its group's content
may change (the group is taken for new content, reclaimed, or gives its pages back). Every
change logs to the manager's journal.

The functions at the end plan a hit's copy for a VmemManager: the longest run of blocks after
a prompt's whole-page hits that some group holds (held, or cached) is copied into the new
sequence's own page (``CopyExtent(..., num_tokens)``, one per kind); the source is held while
the allocation runs, and mapped for the copy at a page index nobody reads when it is mapped
nowhere. Eviction stays by page group: a group nobody holds stays cached (the policy orders
it) while it holds a registered full page or any published block, so a partial page is kept
as a full one is; a copy from it counts as a hit and as a release (lru: it goes to the back);
it is freed only when the policy evicts it, its blocks with it.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional

from .journal import JDict, TxnCell, journaled
from .ops import CopyExtent
from .prefix import (TOKEN_BYTES, HeldSeq, add_child, discard_child, namespace_root,
                     token_bytes)


class GroupBlocks(NamedTuple):
    """What one group's page is indexed by: its parent digest, the ids of its leading whole
    blocks (int64 bytes), their digests, and the hash state after the last one (never
    updated in place: extending copies it)."""
    parent: bytes
    tokens: bytes
    digests: tuple
    state: object


class BlockIndex:
    """digest -> groups holding that block prefix; group -> GroupBlocks.

    Guarantees: ``match`` returns only groups whose parent digest and ids equal the query's
    for every block matched; ``publish`` only extends a group's entry (same parent, ids that
    start with what it held); ``drop`` of a group with no entry is a no-op; an entry published
    as ``chained`` (a page after the first) is named in ``chained_on`` under its parent."""

    def __init__(self, block_tokens: int, cell: Optional[TxnCell] = None) -> None:
        self.block_tokens = block_tokens
        self._cell = TxnCell() if cell is None else cell
        self.by_digest: dict = JDict(self._cell)    # digest -> tuple of groups
        self.by_group: dict = JDict(self._cell)     # group -> GroupBlocks
        self.chained_on: dict = JDict(self._cell)   # page digest -> JSet of groups after it

    def journaled_fields(self) -> bool:
        return all(journaled(v) for v in vars(self).values())

    def blocks_of(self, group: int) -> int:
        entry = self.by_group.get(group)
        return 0 if entry is None else len(entry.digests)

    def publish(self, group: int, parent: bytes, tokens: bytes, chained: bool = False) -> None:
        """``group``'s page holds ``tokens`` (int64 bytes, from the page's first token) after
        ``parent`` (``chained``: a page's digest, else a namespace root): index its whole
        blocks not indexed yet. A group indexed under another parent or other ids is left as
        it is (its entry was dropped before any rewrite, so this cannot happen; checked by
        ``check``'s callers)."""
        width = self.block_tokens * TOKEN_BYTES
        entry = self.by_group.get(group)
        old = 0 if entry is None else len(entry.digests)
        new = len(tokens) // width
        if new <= old:
            return
        if entry is not None and (entry.parent != parent or
                                  tokens[:old * width] != entry.tokens):
            return
        state = hashlib.sha256(parent) if entry is None else entry.state.copy()
        digests = [] if entry is None else list(entry.digests)
        for b in range(old, new):
            state.update(tokens[b * width:(b + 1) * width])
            digest = state.copy().digest()
            digests.append(digest)
            self.by_digest[digest] = self.by_digest.get(digest, ()) + (group,)
        self.by_group[group] = GroupBlocks(parent, tokens[:new * width], tuple(digests), state)
        if chained and entry is None:
            add_child(self.chained_on, self._cell, parent, group)

    def publish_pages(self, seq, first_page: int, computed_tokens: int, tokens_per_page: int,
                      root: bytes) -> None:
        """Index the computed whole blocks of ``seq``'s pages from ``first_page`` on (a
        HeldSeq: its groups, ids and page keys; ``root`` its namespace root)."""
        tpp, bt, ids = tokens_per_page, self.block_tokens, seq.ids
        upto = min(computed_tokens, len(ids))
        for p in range(first_page, min(upto // tpp, len(seq.units) - 1) + 1):
            g = seq.units[p]
            n = (min(upto, (p + 1) * tpp) - p * tpp) // bt * bt
            if g is None or (p and len(seq.keys) < p) or n <= self.blocks_of(g) * bt:
                continue
            parent = seq.keys[p - 1].digest if p else root
            self.publish(g, parent, token_bytes(ids[p * tpp:p * tpp + n]), chained=p > 0)

    def match_page(self, keys: list, ids: list, page: int, limit_tokens: int,
                   tokens_per_page: int, root: bytes) -> tuple:
        """(groups, tokens): the groups holding the most whole blocks of page ``page`` of a
        prompt (its page keys and ids), within its first ``limit_tokens`` tokens."""
        tpp, bt = tokens_per_page, self.block_tokens
        max_blocks = min(min(limit_tokens, len(ids)) - page * tpp, tpp) // bt
        if max_blocks <= 0:
            return (), 0
        start, parent = page * tpp, keys[page - 1].digest if page else root
        groups, blocks = self.match(parent, token_bytes(ids[start:start + max_blocks * bt]),
                                    max_blocks)
        return groups, blocks * bt

    def match(self, parent: bytes, tokens: bytes, max_blocks: int) -> tuple:
        """(groups, blocks): the groups holding the longest verified prefix of ``tokens``'s
        first ``max_blocks`` blocks after ``parent``, and how many blocks that is ((), 0: none)."""
        width, state, best = self.block_tokens * TOKEN_BYTES, hashlib.sha256(parent), ((), 0)
        for b in range(max_blocks):
            end = (b + 1) * width
            state.update(tokens[b * width:end])
            groups = self.by_digest.get(state.copy().digest(), ())
            found = tuple(g for g in groups if self.by_group[g].parent == parent and
                          self.by_group[g].tokens[:end] == tokens[:end])
            if not found:
                break
            best = (found, b + 1)
        return best

    def drop(self, group: int) -> None:
        """Forget ``group``'s blocks (its content is about to change or go)."""
        entry = self.by_group.pop(group, None)
        if entry is None:
            return
        if group in self.chained_on.get(entry.parent, ()):
            discard_child(self.chained_on, entry.parent, group)
        for digest in entry.digests:
            rest = tuple(g for g in self.by_digest[digest] if g != group)
            if rest:
                self.by_digest[digest] = rest
            else:
                del self.by_digest[digest]

    def drop_chained_on(self, digest: bytes) -> list:
        """Forget the blocks of every group chained on the page registration ``digest`` names
        (it went: no prompt reaches them now); returns those groups, lowest first."""
        groups = sorted(self.chained_on.get(digest, ()))
        for group in groups:
            self.drop(group)
        return groups

    def drop_orphaned(self, group: int, registered) -> None:
        """Forget ``group``'s blocks if they are chained on a page digest not in
        ``registered`` (published after that page's registration went: none reaches them)."""
        entry = self.by_group.get(group)
        if entry is not None and entry.parent not in registered and \
                group in self.chained_on.get(entry.parent, ()):
            self.drop(group)

    def check(self) -> None:
        """The maps agree; ``chained_on`` names only entries under their own parent."""
        for group, entry in self.by_group.items():
            for digest in entry.digests:
                assert group in self.by_digest.get(digest, ()), (group, digest)
        for parent, groups in self.chained_on.items():
            assert groups and all(self.by_group[g].parent == parent for g in groups), parent
        for digest, groups in self.by_digest.items():
            assert groups and len(set(groups)) == len(groups), (digest, groups)
            for g in groups:
                assert digest in self.by_group[g].digests, (g, digest)


# -- a vmem manager's block-granular hits (VmemManager.allocate): which group to copy from,
#    where its source is mapped for the copy, the CopyExtent ops --
def copy_tokens(m, seq: HeldSeq, pi: int, src: int, num_tokens: int) -> None:
    """Copy tokens [0, num_tokens) of held group ``src`` into page ``pi`` of ``seq`` (its
    own, backed), then let ``src`` go. A source mapped nowhere is mapped for the copy at
    a page index nobody uses (``_copy_site``), and unmapped after it."""
    slot, owner, temp = seq.slot, m.slots.owner[seq.slot], False
    if m.slots.maps[src]:
        src_slot, src_pi = min(m.slots.maps[src])
    else:
        src_slot, src_pi = _copy_site(m, slot, len(seq.units))
        if src_pi in m.slots.pages[src_slot]:
            m._unmap(src_slot, src_pi)   # a deferred mapping: refs 0, nothing of ours
        m._emit_map(src_slot, src_pi, src)
        temp = True
    for k, kind in enumerate(m.kinds):
        if m.table.extent(k, src):
            m._ops.append(CopyExtent(src_slot, src_pi, slot, pi, kind.name,
                                     owner=owner, num_tokens=num_tokens))
    if temp:
        m._emit_unmap(src_slot, src_pi, src)
    m._cache.note_hit(src)
    m._unhold(src)


def block_hit(m, num_tokens: int, token_ids, namespace, hits: list,
              need: int) -> Optional[tuple]:
    """(group, tokens): the group holding the most blocks of the prompt's page after its
    whole-page ``hits`` (a held one first), never the last token, else None; None too when
    holding the group (its pages, if nobody holds it) while the allocation takes ``need``
    pages would not fit."""
    if m.blocks is None or token_ids is None:
        return None
    tpp, keys = m.tokens_per_page, m._prompt_keys(token_ids, namespace)
    root = namespace_root(namespace, m.model.kv_encoding)
    # (m._memo[1]: the prompt's ids, as _prompt_keys keyed them)
    groups, tokens = m.blocks.match_page(keys, m._memo[1], len(hits), num_tokens - 1,
                                         tpp, root)
    if not tokens:
        return None
    held = [g for g in groups if m._refs[g]]
    if (not held and -(-num_tokens // tpp) >= m.pages_per_slot
            and len(m.slots.free) < 2 and _site_past_a_sequence(m) is None):
        return None        # no page index left to map an unmapped source at for the copy
    g = min(held or groups)
    if need + (0 if m._refs[g] else m.table.pages_of(g)) > m._available_units():
        return None        # no room to keep the source while the new pages are taken
    return (g, tokens)


def _copy_site(m, slot: int, used_pages: int) -> tuple:
    """(slot, page index) nobody reads, to map a copy's source at: the highest page index
    of ``slot`` past its ``used_pages``, else page 0 of another free slot, else a page
    index past a running sequence's pages (a prompt filling its slot, pages_per_slot 1
    say: block_hit offers a copy only where one of these exists)."""
    pages = m.slots.pages[slot]
    unused = [q for q in range(used_pages, m.pages_per_slot) if q not in pages]
    if unused:
        return slot, unused[-1]
    if used_pages < m.pages_per_slot:
        return slot, m.pages_per_slot - 1     # mapped there only by a deferred mapping
    free = [s for s, _ in m.slots.free.items() if s != slot]
    return (min(free), 0) if free else _site_past_a_sequence(m)


def _site_past_a_sequence(m) -> Optional[tuple]:
    """(slot, page index) past a running sequence's pages and mapped nowhere, or None."""
    for s, seq_id in enumerate(m.slots.owner):
        if seq_id is not None:
            pages, used = m.slots.pages[s], len(m._seqs[seq_id].units)
            for q in range(m.pages_per_slot - 1, used - 1, -1):
                if q not in pages:
                    return s, q
    return None


def reached_groups(m, seq: HeldSeq) -> list:
    """The groups a prompt of swapped ``seq``'s published keys reaches (``unpublish``): its
    whole-page hits, then the groups holding blocks of the page after them."""
    pages = m.prefix.match(seq.keys[:seq.published])
    if m.blocks is None or seq.ids is None:
        return pages
    root = namespace_root(seq.namespace, m.model.kv_encoding)
    groups, _ = m.blocks.match_page(seq.keys, seq.ids, len(pages), seq.num_tokens,
                                    m.tokens_per_page, root)
    return pages + list(groups)
