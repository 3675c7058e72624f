"""A memory manager and the cache that executes its plans, built to fit each other.

    kv = make_kv(CacheConfig(...), "vmem", layout="per-layer")
    kv.manager.allocate(0, 10); kv.cache.execute(kv.manager.take_ops()); kv.sync_tables([0])
    check_matches(kv.manager, kv.cache)      # memory and replica equal the manager's tables

The cache never sees the manager: it is built from the CacheConfig and the pool sizes the
manager derived, and learns everything else from plans. ``check_matches`` is the one place
where the two are compared (tests, and the engine's integrity checks).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Optional

from vmemkv import vmem
from vmemkv.scheduler.layout import CacheKind, CacheLayout
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.geometry import PageGeometry, default_page_bytes as _default_page_bytes
from vmemkv.scheduler.managers import DEFAULT_EVICTION, make_manager
from vmemkv.scheduler.managers.ledger import RELEASED
from vmemkv.scheduler.plan import SwapOut
from vmemkv.scheduler.tables import TableTracker, tracker_for
from vmemkv.vmem.checks import check_flag
from vmemkv.vmem.driver import check_driver

from .cache import KVCache, PagedKVCache, VMemKVCache
from .config import CacheConfig, check_cache_config
from .errors import CacheConfigError, CacheStateError
from .memory import TABLE_BYTES_PER_BLOCK, check_swap_fits, check_tables_fit

CACHE_KINDS = tuple(k.value for k in CacheKind)


def default_page_bytes(config: CacheConfig, layout: str) -> int:
    """2 MiB on CUDA; on the host the smallest multiple of 64 KiB holding whole tokens."""
    return _default_page_bytes(layout, config.num_layers, config.layer_bytes_per_token,
                               on_cuda=config.torch_device.type == "cuda")


def in_model_dtype(config: CacheConfig) -> CacheConfig:
    """``config`` with K/V stored in the model's dtype (``kv_cache_dtype="auto"``)."""
    return replace(config, kv_cache_dtype="auto", kv_scales=None)


def same_tokens_page_bytes(config: CacheConfig, layout: str) -> int:
    """On the host, the default page of ``config`` in the model's dtype, scaled by the stored
    dtype's bytes: a page holds the same tokens whatever ``kv_cache_dtype``, so a cache whose
    rows round up to whole pages saves the bytes the dtype saves (the default page holds 4x the
    tokens in int8 of an fp32 model, and a small ``max_context`` committed fp32's bytes). A
    multiple of 16 KiB (a multiple of 64 KiB, divided by at most 4). CUDA keeps 2 MiB (its VMM
    granularity). VMemCache's default; the engine keeps ``default_page_bytes``."""
    plain = in_model_dtype(config)
    page = default_page_bytes(plain, layout)
    if config.torch_device.type == "cuda":
        return page
    return page * config.element_bytes // plain.element_bytes


def vmem_geometry(config: CacheConfig, layout: str = "per-layer",
                  page_bytes: Optional[int] = None) -> PageGeometry:
    """The page geometry of a vmem cache of ``config`` (default page size: see above)."""
    return PageGeometry.of(config, page_bytes or default_page_bytes(config, layout), layout)


@dataclass
class KV:
    """A manager, the cache executing its plans, and the tracker that writes its table edits,
    driven as one (the way tests, benchmarks and the engine's owner use them).

    ``execute``/``begin_step``/``read`` send the cache the placements of the sequences they
    name before touching memory, as a plan would; ``check_integrity`` is ``check_matches``.
    Any other attribute is the cache's (``range``, ``pool``, ``layer_view``, ...).
    """
    manager: object
    cache: KVCache
    tables: TableTracker

    def sync_tables(self, seq_ids: Iterable[int], dropped: Iterable[int] = ()) -> list:
        """Send the cache the placements of ``seq_ids`` (resident) and drop ``dropped``, as a
        plan would; returns the edits sent."""
        edits = self.tables.edits(self.manager, seq_ids, dropped)
        self.cache.apply_tables(edits)
        return edits

    def execute(self, ops) -> None:
        """The cache executes ``ops``; placements of swapped-out sequences are dropped."""
        self.cache.execute(ops)
        gone = [op.seq_id for op in ops if isinstance(op, SwapOut)]
        if gone:
            self.sync_tables((), dropped=gone)

    def begin_step(self, seqs):
        """As the cache's, after checking every write against the tokens the manager holds."""
        for seq_id, computed, new in seqs:
            held = self.manager.num_tokens(seq_id)
            if computed + new > held:
                raise CacheStateError(
                    f"sequence {seq_id}: writing tokens up to {computed + new} but the manager "
                    f"holds {held}; grow it with the manager (allocate/append) first")
        self.sync_tables([s[0] for s in seqs])
        return self.cache.begin_step(seqs)

    def read(self, seq_id: int, layer: int, num_tokens: int):
        held = self.manager.num_tokens(seq_id)
        if num_tokens > held:
            raise CacheStateError(f"sequence {seq_id} holds {held} tokens, asked to read {num_tokens}")
        self.sync_tables([seq_id])
        return self.cache.read(seq_id, layer, num_tokens)

    def check_integrity(self) -> None:
        check_matches(self.manager, self.cache)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("manager", "cache", "tables"):
            raise AttributeError(name)
        return getattr(self.cache, name)

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> "KV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def full_length_tokens(max_context: int, kind: str, block_size) -> int:
    """The tokens a slot's share of a default cache (``cache_bytes=None``: every slot at full
    length) must hold: paged, ``max_context`` in whole blocks (every block group's last block
    is whole: unrounded, a request of ``max_context`` tokens could never fit); vmem,
    ``max_context`` as given (the caller rounds it to whole pages)."""
    if kind == "paged" and isinstance(block_size, int) and block_size > 0:
        return -(-max_context // block_size) * block_size
    return max_context


# the options of make_kv only a vmem cache reads, at their defaults (EngineConfig's too): a
# paged cache given another value would ignore it, so it is refused (``vmem_only_given``)
VMEM_ONLY_DEFAULTS = dict(layout="per-layer", page_bytes=None, background_mapper=False,
                          driver=None, grow_pages=False, hybrid_parts=True)


def vmem_only_given(kind, **options) -> dict:
    """Those of ``options`` (vmem-only options by name, see ``VMEM_ONLY_DEFAULTS``) that a
    ``kind`` cache would ignore: any not at its default when ``kind`` is paged, else none."""
    if CacheKind(kind) is not CacheKind.PAGED:
        return {}
    return {name: value for name, value in options.items()
            if value != VMEM_ONLY_DEFAULTS[name]}


def check_vmem_only(who: str, kind: str, **options) -> None:
    """CacheConfigError naming the first of ``options`` a ``kind`` cache would ignore (a vmem
    option given to a paged cache was accepted and did nothing)."""
    ignored = vmem_only_given(kind, **options)
    if ignored:
        name, value = next(iter(ignored.items()))
        raise CacheConfigError(f"{who}: {name} {repr(value)[:60]} applies to kind='vmem' only; "
                               f"with kind='paged' it would do nothing: drop it")


def check_kv_arguments(who: str, config, *, page_bytes=None, driver=None,
                       background_mapper=False, grow_pages=False) -> None:
    """CacheConfigError naming the argument of ``who`` (make_kv, VMemCache, cache_from_layout)
    that is not what it must be, before anything is built: ``config`` no CacheConfig,
    ``page_bytes`` neither None (the default page) nor an int >= 1 (0 and {} were read as the
    default, which EngineConfig refuses), ``driver`` neither None nor a vmem Driver (``"host"``
    failed deep in the pool; 0 was read as the default driver), a flag not True or False (a
    truthy "no" turned it on)."""
    check_cache_config(config, who)
    if page_bytes is not None and (isinstance(page_bytes, bool) or not isinstance(page_bytes, int)
                                   or page_bytes < 1):
        raise CacheConfigError(f"{who}: page_bytes must be an int >= 1 or None (the default "
                               f"page), got {type(page_bytes).__name__} {repr(page_bytes)[:60]}")
    if driver is not None:
        check_driver(driver, f"{who}: driver", CacheConfigError)
    for name, value in (("background_mapper", background_mapper), ("grow_pages", grow_pages)):
        check_flag(value, f"{who}: {name}", CacheConfigError)


def make_kv(config: CacheConfig, kind: str = "vmem", *, cache_bytes: Optional[int] = None,
            layout: str = "per-layer", page_bytes: Optional[int] = None,
            block_size: int = 16, swap_bytes: int = 0, background_mapper: bool = False,
            driver: Optional[vmem.Driver] = None, grow_pages: bool = False,
            prefix_eviction: str = DEFAULT_EVICTION, hybrid_parts: bool = True,
            max_cache_bytes: Optional[int] = None,
            adapter_budget_bytes: Optional[int] = None) -> KV:
    """Build the manager (scheduler.managers) and a cache of ``kind`` for ``config``.

    cache_bytes: device memory for K/V (default: room for every slot at full length).
    vmem: ``layout`` per-layer | interleaved, ``page_bytes`` (default: see default_page_bytes);
    each slot holds ``config.max_context`` rounded up to whole pages (as the engine's);
    ``grow_pages``: create physical pages on first mapping, up to ``cache_bytes``
    (vmem.PagePool(grow=True)); default: all created up front.
    ``hybrid_parts``: a hybrid model (full and windowed layers) in the per-layer layout splits
    page groups into a full and a windowed kind and gives back the windowed one behind the window
    (scheduler.managers.vmem_kinds; the ops name each kind's pool pages); False: full allocation.
    paged: ``block_size`` tokens per block; vmem: prefix hits in blocks of ``block_size``
    tokens, the part of a page a hit covers copied (scheduler/managers/blocks.py). ``prefix_eviction``: the managers' retention of
    computed prefixes (scheduler.managers.eviction). ``max_cache_bytes`` (vmem): the most
    ``manager.resize`` may grow the pool to (default ``cache_bytes``).
    ``adapter_budget_bytes`` (None: LoRA adapters share the pool with KV): a static split, that
    many of the ``cache_bytes`` for adapters only (scheduler/managers/adapters.py).
    Arguments of the wrong kind are refused first, by name (``check_kv_arguments``), then a
    vmem-only option given to a paged cache, which would ignore it (``check_vmem_only``).
    """
    check_kv_arguments("make_kv", config, page_bytes=page_bytes, driver=driver,
                       background_mapper=background_mapper, grow_pages=grow_pages)
    if kind not in CACHE_KINDS:
        raise CacheConfigError(f"cache must be 'vmem' or 'paged', got {kind!r}")
    check_vmem_only("make_kv", kind, layout=layout, page_bytes=page_bytes,
                    background_mapper=background_mapper, driver=driver, grow_pages=grow_pages,
                    hybrid_parts=hybrid_parts)
    if CacheKind(kind) is CacheKind.VMEM:
        if page_bytes is None:
            page_bytes = default_page_bytes(config, layout)
        config = replace(config, max_context=vmem_geometry(config, layout, page_bytes)
                         .round_up_tokens(config.max_context))
    if cache_bytes is None:
        cache_bytes = config.max_batch * full_length_tokens(config.max_context, kind, block_size) \
            * config.bytes_per_token
    model = config.model_spec()
    if CacheKind(kind) is CacheKind.VMEM:
        largest = max(cache_bytes, max_cache_bytes) if isinstance(max_cache_bytes, int) \
            else cache_bytes
        if isinstance(largest, int) and isinstance(page_bytes, int) and page_bytes > 0:
            check_tables_fit(largest // page_bytes, f"{largest} bytes of {page_bytes}-byte "
                                                    f"pages: the larger of cache_bytes and "
                                                    f"max_cache_bytes or a budget's total")
        manager = make_manager("vmem", model, cache_bytes, config.max_context, page_bytes=page_bytes,
                               layout=layout, max_slots=config.max_batch, swap_bytes=swap_bytes,
                               prefix_eviction=prefix_eviction, hybrid_parts=hybrid_parts,
                               prefix_block_tokens=block_size, max_cache_bytes=max_cache_bytes,
                               adapter_budget_bytes=adapter_budget_bytes)
    else:
        if max_cache_bytes not in (None, cache_bytes):
            raise CacheConfigError("max_cache_bytes needs the vmem cache (only its pool resizes)")
        block_bytes = block_size * config.bytes_per_token if isinstance(block_size, int) else 0
        if isinstance(cache_bytes, int) and block_bytes > 0:
            check_tables_fit(cache_bytes // block_bytes, f"{cache_bytes} bytes of "
                             f"{block_bytes}-byte blocks: cache_bytes",
                             TABLE_BYTES_PER_BLOCK, "blocks")
        manager = make_manager("paged", model, cache_bytes, config.max_context,
                               block_size_tokens=block_size, swap_bytes=swap_bytes,
                               prefix_eviction=prefix_eviction,
                               adapter_budget_bytes=adapter_budget_bytes)
    check_swap_fits(swap_bytes, config.torch_device, cache_bytes)   # validated by the manager
    cache = cache_for(manager, config, driver=driver, background_mapper=background_mapper,
                      grow_pages=grow_pages)
    return KV(manager, cache, tracker_for(kind))


def cache_for(manager, config: CacheConfig, *, driver: Optional[vmem.Driver] = None,
              background_mapper: bool = False, grow_pages: bool = False) -> KVCache:
    """The cache that executes ``manager``'s plans: ``cache_from_layout(manager.layout(), ...)``;
    CacheConfigError for a manager whose plans no cache executes (reserve-*). The cache keeps
    no reference to the manager."""
    try:
        layout = manager.layout()
    except ConfigError as error:
        raise CacheConfigError(str(error)) from error
    return cache_from_layout(layout, config, driver=driver,
                             background_mapper=background_mapper, grow_pages=grow_pages)


def cache_from_layout(layout: CacheLayout, config: CacheConfig, *,
                      driver: Optional[vmem.Driver] = None, background_mapper: bool = False,
                      grow_pages: bool = False) -> KVCache:
    """The cache (vmem or paged) a manager declared in ``layout``, built from it alone (in any
    process: a tensor-parallel rank, a replay); raises CacheConfigError when it does not fit
    ``config``. ``background_mapper``/``grow_pages``/``driver``: vmem only, refused for paged
    (``check_vmem_only``; their types checked for both: ``check_kv_arguments``)."""
    check_kv_arguments("cache_from_layout", config, driver=driver,
                       background_mapper=background_mapper, grow_pages=grow_pages)
    if not isinstance(layout, CacheLayout):
        raise CacheConfigError(f"a cache is built from a CacheLayout (manager.layout()), "
                               f"got {layout!r}")
    check_vmem_only("cache_from_layout", layout.kind.value, driver=driver,
                    background_mapper=background_mapper, grow_pages=grow_pages)
    if layout.kind is CacheKind.PAGED:
        return PagedKVCache(config, layout.block_size_tokens, layout.num_blocks,
                            layout.block_groups, adapter_blocks=layout.adapter_pool_pages)
    if layout.num_slots != config.max_batch:
        raise CacheConfigError(f"manager has {layout.num_slots} slots but CacheConfig.max_batch "
                               f"is {config.max_batch}; build the manager with max_slots=max_batch")
    if layout.max_seq_len_tokens != config.max_context:
        raise CacheConfigError(
            f"manager slots hold {layout.max_seq_len_tokens} tokens but "
            f"CacheConfig.max_context is {config.max_context}")
    return VMemKVCache(config, layout.geometry, layout.num_groups, driver=driver,
                       background_mapper=background_mapper, grow_pages=grow_pages,
                       pool_pages=layout.pool_pages, kinds=layout.kinds,
                       released_pages=layout.released_pages,
                       adapter_pool_pages=layout.adapter_pool_pages)


def check_matches(manager, cache: KVCache) -> None:
    """Assert (AssertionError on a bug) that both are consistent and that the cache's memory and
    replica equal the manager's tables: mapped pages per slot (vmem), the placement of every
    placed sequence the manager still holds, the resident LoRA adapters (their pool pages or
    blocks and sizes) and the swap space. It holds once the manager's ops have run: a step that
    forks a sample or finishes a sequence may leave ops the next plan carries (an engine: check
    after a step that planned nothing new, or after ``run_until_done``)."""
    manager.check_integrity()
    cache.check_integrity()
    layout = manager.layout()
    assert cache.kind is layout.kind, f"a {cache.kind.value} cache for a {layout.kind.value} layout"
    vmem_kind = layout.kind is CacheKind.VMEM
    for seq_id in cache.placed_seq_ids:
        if manager.is_swapped(seq_id) or not _resident(manager, seq_id):
            continue   # finished or preempted since the last plan: its drop is in the next one
        truth = manager.slot_of(seq_id) if vmem_kind else tuple(manager.block_tables(seq_id))
        assert cache.placement(seq_id) == truth, f"placement of sequence {seq_id}"
    if vmem_kind:
        for slot in range(cache.config.max_batch):
            assert cache.mapped_extents(slot) == manager.mapped_extents(slot), \
                f"pool pages mapped under slot {slot}"
        # pages given back to the device have no memory behind them (elastic pools)
        ledger, pool = manager.ledger, cache.pool
        backed = [p for p in range(ledger.num_pages)
                  if ledger.holder(p) == RELEASED and pool.has_memory(p)]
        assert not backed, f"released pool pages {backed[:8]} still have memory"
        assert pool.grow or pool.committed_pages <= \
            ledger.in_service_pages + layout.adapter_pool_pages, "memory past service"
    assert cache.resident_adapters() == manager.resident_adapters(), "resident adapters"
    swapped = cache.swapped_tokens()
    for seq_id, tokens in swapped.items():
        assert manager.is_swapped(seq_id), f"swap space holds unknown sequence {seq_id}"
        assert tokens == manager.num_tokens(seq_id), f"swap size of {seq_id}"
    used_bytes = manager.swap_bytes - manager.swap_free_bytes
    assert sum(swapped.values()) * manager.bytes_per_token == used_bytes, "swap space accounting"


def _resident(manager, seq_id: int) -> bool:
    try:
        manager.num_tokens(seq_id)
    except Exception:
        return False
    return True
