"""The managers' integrity checks, functions of a manager's state (they change nothing): every
invariant recomputed from scratch and compared. vmem: slots, page groups, mappings, reference
counts, per-kind extents, prefix cache and running sums; paged: block tables per group,
reference counts, the free / held / cached / adapter split, running sums.

The idle checks (``idle_vmem``, ``idle_paged``) are what must hold once no sequence is resident
or swapped, read from counters the managers keep (O(1), but for a byte-backed vmem pool's
cached groups): nothing held, every unit and page accounted to what outlives sequences (free,
the prefix cache, idle adapters). The scheduler runs them at every idle step; the full check
runs where asked (``SchedulerConfig.check_every_step``, tests)."""
from __future__ import annotations

from .paged_groups import anchor_groups
from .window import dropped_in, dropped_units, held_units


def check_vmem(m) -> None:
    """``VmemManager.check_integrity``."""
    tpp, refs = m.tokens_per_page, [0] * m.num_groups
    for seq_id, seq in m._seqs.items():
        assert m.slots.owner[seq.slot] == seq_id and seq.slot not in m.slots.free
        assert len(seq.units) == -(-seq.num_tokens // tpp), "page count"
        gone = dropped_units(seq)
        assert None not in seq.units[gone:], ("given back past the window's start", seq_id)
        for pi, g in enumerate(seq.units[gone:], start=gone):
            refs[g] += 1
            assert m.slots.pages[seq.slot].get(pi) == g, ("unmapped page in use", seq_id, pi)
            assert m._fill[g] == min(tpp, seq.num_tokens - pi * tpp), ("fill", g)
    assert refs == m._refs, "reference counts"
    maps = [set() for _ in range(m.num_groups)]
    for slot, pages in enumerate(m.slots.pages):
        for pi, g in pages.items():
            maps[g].add((slot, pi))
        free = m.slots.owner[slot] is None
        assert free == (slot in m.slots.free)
    assert maps == list(m.slots.maps), "mapping index"
    assert all(c == len(m.slots.pages[s]) for s, c in m.slots.free.items())
    free, spare = set(m._free), set(m._spare)
    assert len(free) == len(m._free) and len(spare) == len(m._spare)
    assert not spare & free, "a group both free and spare"
    registered = set(m.prefix.by_unit)
    if m.blocks is not None:
        m.blocks.check()
        kept = set(m.blocks.by_group)
        assert all(refs[g] or g in m._cache for g in kept), "blocks of a group gone"
        assert all(m.blocks.blocks_of(g) * m.block_tokens <= m._fill[g]
                   for g in kept), "blocks past a group's fill"
        registered |= kept           # retained like a registered group
    assert all(refs[g] == 0 and not maps[g] and g not in registered for g in free | spare)
    assert set(m._reclaimable) == {g for g in range(m.num_groups)
                                      if not refs[g] and maps[g] and g not in registered}
    cached = set(m._cache)
    assert len(cached) == len(m._cache)
    assert cached == {g for g in registered if not refs[g]}, "cached: retained, unheld"
    assert m.cached_tokens == sum(m._retained(g) for g in cached), "cached tokens: kept ones"
    held = sum(1 for g in range(m.num_groups) if refs[g])
    assert held + len(free) + len(m._reclaimable) + len(cached) + len(spare) == \
        m.num_groups, "free + reclaimable + cached + held + spare == total"
    assert m._live == sum(m._fill[g] for g in range(m.num_groups) if refs[g])
    assert m._cap_sum == sum(len(held_units(s)) * tpp for s in m._seqs.values())
    assert m._tok_sum == sum(s.num_tokens - dropped_units(s) * tpp for s in m._seqs.values())
    m.prefix.check()
    m._swap_integrity()
    _check_extents(m, refs, maps, spare)
    _check_frontiers(m, refs, maps)
    names = {kind.name for kind in m.kinds}
    m._check_adapters(lambda tenant: tenant in names)


def _check_extents(m, refs: list, maps: list, spare: set) -> None:
    """Each group's extents as the backing and release rules say: kind by kind over whole
    columns of backed member pages (this runs after every step in tests, over every group)."""
    table, geo, cached, partial = m.table, m.geometry, set(m._cache), m._partial
    table.check_integrity()
    assert m.bound_pages <= m.pool_pages, "pages bound"
    assert m._idle == sum(table.pages_of(g) for g in m._reclaimable), "idle pages"
    backed = [[n // members for n in map(len, extents)]       # backed[k][g]: member pages
              for extents, members in zip(table._extents, table.members)]
    first = next(col for k, col in enumerate(backed) if k not in m._win)   # a kept kind's
    for k, col in enumerate(backed):
        assert not any(col[g] for g in spare), ("spare group keeps pages", k)
        if col is first:
            continue
        windowed = k in m._win
        for g, (pages, kept_pages) in enumerate(zip(col, first)):
            if g in partial:
                assert not (windowed and pages), ("partial group's window backed", g, k)
            else:
                assert pages == kept_pages or g in spare, ("kinds backed alike", g, k)
    k_max, fill, registered = geo.pages_per_member, m._fill, m.prefix.by_unit
    for g, kept_pages in enumerate(first):
        if g in spare:
            continue
        if m._whole:
            assert kept_pages == k_max, ("whole backing", g, kept_pages)
        elif refs[g]:
            assert kept_pages == geo.member_pages_for(fill[g]), ("held backing", g, kept_pages)
        elif g in cached:
            assert kept_pages == k_max if g in registered else \
                kept_pages >= geo.member_pages_for(fill[g]), ("cached backing", g, kept_pages)
        else:
            assert maps[g] and 1 <= kept_pages <= k_max, ("reclaimable backing", g, kept_pages)


def _check_frontiers(m, refs: list, maps: list) -> None:
    """The release rule's frontiers: holders that dropped the windowed kinds, per group."""
    drops = [0] * m.num_groups
    for slot, gone in enumerate(m._win_gone):
        seq = m._seqs.get(m.slots.owner[slot])
        assert gone == 0 or (m._win and seq is not None and gone <= len(seq.units) - 1), \
            ("frontier", slot)
        for pi in range(gone):
            drops[seq.units[pi]] += 1
    assert drops == list(m._win_drop), "window drops per group"
    for g in range(m.num_groups):
        if g in m._partial:
            assert refs[g] and drops[g] == refs[g] and g not in m.prefix.by_unit, g
            assert all(pi < m._win_gone[s] for s, pi in maps[g]), ("whole partial", g)
        else:
            assert drops[g] < refs[g] or refs[g] == 0 == drops[g], ("window unreleased", g)


def check_paged(m) -> None:
    """``PagedManager.check_integrity``."""
    bs, refs = m.block_size, [0] * m.num_blocks
    cap = tok = 0
    ledger = m._ledger
    for seq in m._seqs.values():
        tables = m._tables(seq)
        assert len(tables) == len(m.groups), "a table per group"
        for g, units in enumerate(tables):
            assert len(units) == -(-seq.num_tokens // bs), "block table length"
            gone = dropped_in(units)
            assert not gone or m.groups[g].window_tokens, "a full group gave back"
            assert None not in units[gone:], "given back past the window's start"
            for k, b in enumerate(units[gone:], start=gone):
                refs[b] += 1
                assert m._fill[b] == min(bs, seq.num_tokens - k * bs), ("fill", b)
                assert ledger.holder(b) == g or not m._hybrid, ("tenant", b, g)
            cap += (len(units) - gone) * bs
            tok += seq.num_tokens - gone * bs
    assert refs == m._refs, "reference counts"
    ledger.check_integrity()
    free = {b for b in range(m.num_blocks) if ledger.holder(b) is None}
    cached = set(m._cache)
    assert not free & cached
    assert all(refs[b] == 0 and b not in m.prefix.by_unit for b in free)
    assert all(refs[b] == 0 and b in m.prefix.by_unit for b in cached)
    held = sum(1 for r in refs if r)
    assert held + len(free) + len(cached) + m._kv_adapter_pages == m.num_blocks, \
        "free + held + cached + adapters == total"
    assert len(cached) == len(m._cache)
    assert m.cached_tokens == _cached_prefix_tokens(m, cached), "cached tokens: once a prefix"
    assert all(refs[b] or b in cached for b in m.prefix.by_unit), "registered: held or cached"
    assert m._live == sum(m._fill[b] for b in range(m.num_blocks) if refs[b])
    assert m._cap_sum == cap and m._tok_sum == tok, "capacity and token sums"
    m.prefix.check()
    if m._hybrid:     # a block is registered for the group that holds it, no other
        assert all(ledger.holder(b) == reg.group for b, reg in m.prefix.by_unit.items()), \
            "registered under another group"
    m._swap_integrity()
    m._check_adapters(lambda tenant: type(tenant) is int and 0 <= tenant < len(m.groups))


def _cached_prefix_tokens(m, cached: set) -> int:
    """Tokens a paged manager's cache keeps, each once: a block's; a hybrid's, a prefix node's
    while the block of every anchor group registered under it is cached."""
    if not m._hybrid:
        return len(cached) * m.block_size
    anchors = anchor_groups(m.groups)
    whole = [s for s in m.prefix.nodes
             if all(m.prefix.blocks.get((s, g)) in cached for g in anchors)]
    return len(whole) * m.block_size


def idle_vmem(m) -> None:
    """``VmemManager.check_idle``: every group free, reclaimable, cached or spare, every slot
    free, and the pages bound to groups exactly the unheld groups' (a leak: a group or page held
    with no sequence to give it back)."""
    _idle_units(m)
    unheld = len(m._free) + len(m._reclaimable) + len(m._cache) + len(m._spare)
    assert unheld == m.num_groups and not m._partial, \
        ("page groups held with no sequence", m.num_groups - unheld)
    assert len(m.slots.free) == m.num_slots, ("slots occupied", m.num_slots - len(m.slots.free))
    unused = len(m._free) * m.pages_per_group + m._cached_pages() + m._idle
    assert m.bound_pages == unused, ("pages bound to no unheld group", m.bound_pages - unused)
    kinds_pages = sum(m.ledger.held(kind.name) for kind in m.kinds)
    assert kinds_pages == m.bound_pages, ("kinds' pages against the ledger", kinds_pages)


def idle_paged(m) -> None:
    """``PagedManager.check_idle``: the blocks the block groups hold are the cached ones, and
    free + cached + adapters' == all (a leak: a block held with no sequence to give it back)."""
    _idle_units(m)
    ledger, cached = m._ledger, len(m._cache)
    kv_blocks = sum(ledger.held(g) for g in range(len(m.groups)))
    assert kv_blocks == cached, ("blocks held with no sequence", kv_blocks - cached)
    assert ledger.free_pages + cached + m._kv_adapter_pages == m.num_blocks, \
        "free + cached + adapters == total"


def _idle_units(m) -> None:
    """No sequence, so no live token, held capacity or pinned adapter."""
    assert m._live == m._cap_sum == m._tok_sum == 0, ("tokens held", m._live, m._cap_sum)
    assert m._adapter_idle_pages == m._adapter_pages_held and \
        len(m._idle_adapters) == len(m._resident), "an adapter pinned with nothing running"
