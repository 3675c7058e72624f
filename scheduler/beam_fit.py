"""What a sequence or beam group holds at least, per layer kind: the add-time check that a beam
search could ever run (``Scheduler.add_request`` calls it; ``beam_fit_tokens``, the longest it
accepts, is the server's limit for a beam search), and ``sequence_need``, the most one sequence
holds alone on its way to a length (what submission checks: ``PoolReach.fit_tokens``).

A beam request is refused (``RequestTooLargeError``) when it asks for more beams than a step runs,
or when its group holds more than the whole pool at a length every beam surely reaches: the
first decode step, and the last one (``max_tokens - 1`` past the prompt) when nothing can end the
search early (``Request.runs_to_max_tokens``); ``CacheShrunkError`` where only the pool resized
back up to its max holds it (the pool is counted as it is now, not as it was built; a resize
checks every live beam request so too, ``lifecycle.resize_pool``). At ``length`` tokens the
group holds at least, in every layer kind (a paged block group; a vmem layer kind, or every
layer where nothing is split):

- the kind's unit of each beam's newest token on its own: every beam writes its newest token
  into every layer, and a fork shares whole units only, so each beam copies the partial unit;
- the kind's whole units before it that the next query still reads (from ``length - window``
  for a windowed kind), once.

Counted in the pool's own units, blocks or pages. A vmem unit (a page group) spans
``pages_per_member`` pages of each of the kind's members; where groups are backed only as far as
their bytes need (a token straddles two pages: ``PoolBacking.BYTES``, scheduler/geometry.py) a
beam's partial copy holds ``member_pages_for(fill)`` pages of each. Beams that diverge hold more
than this least (each its own copies of the units since they parted): those fail when the pool
runs out, as any request that outgrows it does. A reserve policy shares nothing: from the first
decode step the group holds ``beam_width`` whole reservations (a fork copies its parent's).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from .errors import CacheShrunkError, RequestTooLargeError
from .layout import CacheKind, PoolBacking

# one layer kind: (its window, pool units per whole unit, pool units of a partial copy of fill)
KindCost = Tuple[Optional[int], int, Callable[[int], int]]


def check_beam_group_fits(request, manager, *, max_running: int,
                          reach_bytes: Optional[int] = None, wake_bytes: int = 0) -> None:
    """RequestTooLargeError, naming the request, when its beam group could never run: in the
    pool as it is now (resized: its size since; CacheShrunkError where it fits the pool resized
    back up to its max; asleep, 0 bytes: ``wake_bytes``, the size it wakes to), or
    (``reach_bytes``: a pool a MemoryBudget resizes) grown to that size. ``Scheduler.resize``
    checks every live beam request so too."""
    width, unit = request.beam_width, manager.fork_unit_tokens
    if width > max_running:
        raise RequestTooLargeError(
            f"request {request.request_id}: beam_width {width} exceeds the {max_running} "
            f"sequences a step runs (max_running)", None, "beam_width")
    from .managers.reserve import ReserveManager   # (managers import this module's users)
    if isinstance(manager, ReserveManager):          # a fork copies the whole reservation
        if request.max_tokens >= 2:
            _check_reserved_group_fits(request, manager, width)
        return
    pools = _pools(manager, reach_bytes, wake_bytes)
    if request.max_tokens < 2 or pools is None:
        return
    pool, most = pools
    what, parts, kinds = unit_costs(manager)
    prompt = request.prompt_len
    need, length = _group_need(prompt, request.max_tokens, width, request.runs_to_max_tokens,
                               unit, kinds)
    if need > pool:
        at = ("its first decode step" if length == prompt + 1 else
              f"{length} tokens (it runs to max_tokens {request.max_tokens})")
        where = f"in each of its {len(kinds)} {parts}, " if len(kinds) > 1 else ""
        read = " that the window reads" if any(window for window, _, _ in kinds) else ""
        shrunk = need <= most     # fits once the pool is resized back up (check_length's rule)
        raise (CacheShrunkError if shrunk else RequestTooLargeError)(
            f"request {request.request_id}: a beam search of {width} beams over a {prompt}-token "
            f"prompt holds at least {need} {what} at {at}: {where}the whole {unit}-token units "
            f"before the newest token{read} once, then each beam's own copy of the newest; more "
            f"than the cache's {pool} {what}"
            f"{'' if manager.cache_bytes else ' (the size it wakes to; it is asleep)'}"
            f"{'' if reach_bytes is None else ' (the most its MemoryBudget share can hold)'}"
            f"{f' at its current size; resized back up it holds {most}' if shrunk else ''}",
            None, "beam_width")


def _check_reserved_group_fits(request, manager, width: int) -> None:
    """A reserve policy holds a sequence's reservation from admission and a fork copies it:
    from its first decode step the group holds ``width`` reservations, one per beam."""
    each = manager.reservation_tokens(request.max_total_len)
    if width * each > manager.total_tokens:
        raise RequestTooLargeError(
            f"request {request.request_id}: a beam search of {width} beams holds {width} "
            f"reservations of {each} tokens ({manager.name}: a fork copies its parent's) from "
            f"its first decode step, {width * each} tokens; more than the cache's "
            f"{manager.total_tokens}", None, "beam_width")


def beam_fit_tokens(prompt: int, width: int, runs_to_max_tokens: bool, manager, limit: int, *,
                    reach_bytes: Optional[int] = None, wake_bytes: int = 0) -> int:
    """The most ``prompt + max_tokens`` (at most ``limit``) a search of ``width`` beams over a
    ``prompt``-token prompt may ask for that ``check_beam_group_fits`` (the same pools, the same
    count) does not refuse as RequestTooLargeError; one it refuses as CacheShrunkError (fits the
    pool resized back up) counts as fitting. At least ``prompt + 1``: one new token is never
    checked. The most the group holds only grows with ``max_tokens`` (``_group_need``)."""
    pools, unit = _pools(manager, reach_bytes, wake_bytes), manager.fork_unit_tokens
    if pools is None or limit < prompt + 2:
        return limit
    kinds = unit_costs(manager)[2]

    def fits(final: int) -> bool:
        return _group_need(prompt, final - prompt, width, runs_to_max_tokens, unit,
                           kinds)[0] <= pools[1]
    low, high = prompt + 1, limit        # low always fits; find the most that does
    if fits(high):
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _pools(manager, reach_bytes: Optional[int], wake_bytes: int) -> Optional[Tuple[int, int]]:
    """(the pool's units as ``check_beam_group_fits`` counts it now, the most it may count
    resized back up), or None where it checks nothing (no fork unit; asleep with no size kept)."""
    now_bytes = manager.cache_bytes or wake_bytes     # asleep: the pool it wakes to
    if not manager.fork_unit_tokens or now_bytes == 0:
        return None
    layout = manager.layout()
    if layout.kind is CacheKind.PAGED:
        pool = layout.num_blocks
    else:   # the pages in service now (the layout's released_pages are construction's)
        pool = manager.pool_units(now_bytes) or \
            layout.pool_pages - layout.released_pages   # (a policy that counts no units)
        if reach_bytes is not None:
            pool = min(layout.pool_pages, reach_bytes // layout.geometry.page_bytes)
    most = pool if reach_bytes is not None else max(pool, manager.pool_units(
        manager.max_cache_bytes))                       # resized back up to its max
    return pool, most


def _group_need(prompt: int, max_tokens: int, width: int, runs_to_max_tokens: bool, unit: int,
                kinds: List[KindCost]) -> Tuple[int, int]:
    """(the most pool units the group surely holds, the length it holds them at): at its first
    decode step and, where nothing ends it early, its last (``max_tokens - 1`` past the prompt)."""
    last = prompt + (max_tokens - 1 if runs_to_max_tokens else 1)
    # at equal positions within a unit the least only grows with the length, so its most over
    # [prompt + 1, last] lies within the last unit's worth of lengths
    return max((_least_held(n, width, unit, kinds), n)
               for n in range(max(prompt + 1, last - unit + 1), last + 1))


def unit_costs(manager) -> Tuple[str, str, List[KindCost]]:
    """What one sequence holds per layer kind, in the pool's units: ("blocks", "block groups",
    a cost per block group) paged, ("pages", "layer kinds", a cost per kind) vmem."""
    layout = manager.layout()
    if layout.kind is CacheKind.PAGED:
        return "blocks", "block groups", [(group.window_tokens, 1, _one) for group in manager.groups]
    return "pages", "layer kinds", _vmem_kinds(manager.kinds, layout.geometry, layout.backing)


def sequence_need(prompt: int, final: int, unit: int, kinds: List[KindCost]) -> int:
    """Pool units one sequence holds at most, alone, on its way from a ``prompt``-token prompt
    to ``final`` tokens: the prompt whole in every kind (allocated at admission, before any
    window gives back), then at each length past it what ``_least_held`` counts for one beam
    (per windowed kind the whole units its window still reads and the newest, as
    ``release_behind_window`` leaves them before each step's append)."""
    need = _least_held(prompt, 1, unit, [(None, whole, part) for _, whole, part in kinds])
    # over lengths where the newest unit and every kind's first unit read stay the same, the
    # units held only grow with the fill of the newest: its most lies at one of those runs'
    # ends, and (as for beams) within the last unit's worth of lengths
    lo = max(prompt + 1, final - unit + 1)
    ends = {final, final - final % unit}
    ends.update(final - (final - window + 1) % unit for window, _, _ in kinds if window)
    return max([need] + [_least_held(n, 1, unit, kinds) for n in ends if n >= lo])


def longest_sequence(prompt: int, pool: int, unit: int, kinds: List[KindCost],
                     limit: int) -> int:
    """The most tokens (at most ``limit``) a sequence of a ``prompt``-token prompt may reach
    with ``sequence_need`` within ``pool`` units; 0 when the prompt alone does not fit."""
    if sequence_need(prompt, prompt, unit, kinds) > pool:
        return 0
    low, high = prompt, limit        # need grows with the final length: low fits, find the most
    if sequence_need(prompt, high, unit, kinds) <= pool:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if sequence_need(prompt, mid, unit, kinds) <= pool else (low, mid)
    return low


def _one(fill: int) -> int:
    return 1


def _vmem_kinds(kinds, geometry, backing: PoolBacking) -> List[KindCost]:
    """Each vmem kind's cost: its members (K and V of each of its layers, or of all layers where
    a page holds every layer) times the pages of one member a whole or partial group holds."""
    k = geometry.pages_per_member
    partial = geometry.member_pages_for if backing is PoolBacking.BYTES else (lambda fill: k)
    costs = []
    for kind in kinds:
        members = 2 * len(kind.layers) if geometry.per_layer else 2
        costs.append((kind.window_tokens, members * k,
                      lambda fill, m=members: m * partial(fill)))
    return costs


def _least_held(length: int, width: int, unit: int, kinds: List[KindCost]) -> int:
    """Pool units a group of ``width`` beams of ``length`` tokens holds at least."""
    newest = (length - 1) // unit
    fill = length - newest * unit
    held = 0
    for window, whole, partial in kinds:
        first_read = max(0, length - window) // unit if window else 0
        held += (newest - first_read) * whole + width * partial(fill)
    return held
