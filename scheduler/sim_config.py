"""What one simulation runs: ``SimConfig``, a deployment (model, device, cache, memory policy,
scheduler and cost options), checked whole when it is made (``ConfigError`` naming the field),
and the factories that build its memory manager, its scheduler settings and its cost model.

A custom policy's failures are blamed on it (``policy_blamed``): what its class raises while
being built or run is a ``PolicyError`` naming the spec, the method and the exception with its
file:line in the policy's code; the built-in managers' errors pass unchanged.
"""
from __future__ import annotations

import inspect
import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Optional, Sequence

from .cost import CostModel
from .errors import ConfigError, PolicyError, RequestTooLargeError
from .field_checks import check_fraction_or_none, check_int, check_number
from .geometry import LAYOUT_CHOICES, PageGeometry, resolve_layout
from .managers import POLICIES, PagedManager, VmemManager
from .managers.base import MemoryManager
from .managers.common import ManagerCore
from .managers.eviction import DEFAULT_EVICTION, make_eviction
from .managers.paged_groups import block_groups
from .policies import check_constructor, check_policy, is_custom, load_policy_class
from .presets import ModelSpec, get_device, get_model, with_kv_cache_dtype
from .profile_cost import load_profile, profile_cost, profile_model
from .scheduler import SchedulerConfig

WATERMARK_SCOPES = ("growing", "all")
# host-to-device copy bandwidth for adapter loads: PCIe 4.0 x16 is 32 GB/s raw (31.5 after
# 128b/130b encoding); ~25 GB/s is what pinned-memory cudaMemcpy reaches in practice
DEFAULT_H2D_BYTES_PER_S = 25e9


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment: model, device, cache, policy, scheduler and cost options."""
    policy: str = "paged"
    model: str = "llama-3-8b"
    device: str = "h100"
    cache_bytes: int = 60 * 10**9         # KV cache budget on the device, bytes
    max_seq_len: int = 4096               # tokens a sequence may reach (prompt + output)
    block_size: int = 16                  # tokens per block (paged)
    page_bytes: int = 2 * 2**20           # bytes per physical page (vmem)
    layout: str = "per-layer"             # vmem page layout
    swap_bytes: int = 0                   # host swap space, bytes
    prefix_eviction: str = DEFAULT_EVICTION   # prefix cache retention: off | lru | hits
    hybrid_parts: bool = True             # vmem per-layer, hybrid model: give back windowed
                                          # layers' pages behind the window (False: full allocation)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefill_mfu: Optional[float] = None   # None: prefill costs only KV bandwidth
    map_latency_s: float = 0.0            # seconds per physical page mapped (vmem)
    prefix_block_tokens: int = 16         # vmem: prefix hits in blocks of this many tokens,
                                          # copied into a new page (0: whole page groups only)
    copy_bytes_per_s: Optional[float] = None   # device copy bandwidth for copy ops (None:
                                          # half the device's memory bandwidth: read + write)
    paged_slowdown: float = 1.0           # KV read-time multiplier for the paged policy
    # "growing": the admission watermark only where sequences grow into free memory (paged, vmem;
    # a reserve policy holds its final length from admission: it would idle memory); "all": all
    watermark_scope: str = "growing"
    profile: Optional[str] = None         # a device profile (vmemkv calibrate) in place of the
                                          # roofline; its model is simulated (``model``: left out)
    kv_cache_dtype: str = "auto"          # K/V storage: bytes per token (memory and the roofline's
                                          # KV read) follow it; auto: the model's dtype_bytes
    beam_width: int = 0                   # > 0: every request a beam search of this many beams
    n: int = 1                            # samples a request (forks share the prompt); 1: beams
    beam_skew: float = 1.0                # BeamModel: how strongly children pile on the best beams
    beam_seed: int = 0                    # BeamModel's draws keyed by it, request, step (--seed)
    adapter_budget_bytes: Optional[int] = None   # LoRA: None, adapters and KV share the pool
                                          # (unified); bytes: a static split, that many for
                                          # adapters, the rest of cache_bytes for KV
    h2d_bytes_per_s: float = DEFAULT_H2D_BYTES_PER_S   # adapter loads (LoadAdapter ops)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)} or module:Class, "
                              f"got {self.policy!r}")
        check_policy(self.policy)
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError(f"scheduler must be a SchedulerConfig, got {self.scheduler!r}")
        if not isinstance(self.hybrid_parts, bool):
            raise ConfigError(f"hybrid_parts must be True or False, got {self.hybrid_parts!r}")
        if self.profile is not None:
            load_profile(self.profile)
        if self.watermark_scope not in WATERMARK_SCOPES:
            raise ConfigError(f"watermark_scope must be one of {', '.join(WATERMARK_SCOPES)}, "
                              f"got {self.watermark_scope!r}")
        if self.layout not in LAYOUT_CHOICES:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUT_CHOICES)}, "
                              f"got {self.layout!r}")
        self._check_sizes()
        with_kv_cache_dtype(get_model(self.model), self.kv_cache_dtype)   # names an unknown one
        if self.profile is not None:
            self._check_roofline_only()
        get_device(self.device)
        make_eviction(self.prefix_eviction)
        check_int("beam_width", self.beam_width, 0)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n must be an int >= 1, got {self.n!r}")
        if self.n > 1 and self.beam_width:
            raise ConfigError(f"n must be 1 with beam_width {self.beam_width} (a beam search "
                              f"returns its beams), got {self.n}")
        check_number("beam_skew", self.beam_skew)
        check_int("beam_seed", self.beam_seed, 0)
        if isinstance(self.prefix_block_tokens, bool) or not isinstance(
                self.prefix_block_tokens, int) or self.prefix_block_tokens < 0:
            raise ConfigError(f"prefix_block_tokens must be an int >= 0, got "
                              f"{self.prefix_block_tokens!r}")
        if self.copy_bytes_per_s is not None:
            check_number("copy_bytes_per_s", self.copy_bytes_per_s, unit="bytes/s", inclusive=False)
        check_number("h2d_bytes_per_s", self.h2d_bytes_per_s, unit="bytes/s", inclusive=False)
        budget = self.adapter_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or not 0 < budget < self.cache_bytes):
            raise ConfigError(f"adapter_budget_bytes must be None (a unified pool) or an int in "
                              f"(0, cache_bytes {self.cache_bytes}), got {budget!r}")
        if not (isinstance(self.paged_slowdown, (int, float)) and 1 <= self.paged_slowdown < 1e300):
            raise ConfigError(f"paged_slowdown must be a finite number >= 1 (a KV read-time "
                              f"multiplier), got {self.paged_slowdown!r}")
        if is_custom(self.policy):            # built with these, only when the run starts
            check_constructor(self.policy, self._options())
        self.check_copy_bandwidth()           # forks; simulate() checks its entries' hash ids

    def _check_sizes(self) -> None:
        """The pool's sizes and the cost's knobs by type and range, before anything is built
        from them (a block or page of 0 was refused as a host-memory error; an infinite cache
        as OverflowError; map_latency_s inf ran, then failed on a NaN duration)."""
        check_number("cache_bytes", self.cache_bytes, unit="bytes", inclusive=False)
        check_number("swap_bytes", self.swap_bytes, unit="bytes")
        check_int("max_seq_len", self.max_seq_len, 1)
        check_int("block_size", self.block_size, 1)
        check_int("page_bytes", self.page_bytes, 1)
        check_fraction_or_none("prefill_mfu", self.prefill_mfu)
        check_number("map_latency_s", self.map_latency_s, unit="seconds")

    def _check_roofline_only(self) -> None:
        """Refuse, by name, the fields a profile's measured step cost would silently ignore."""
        if self.kv_cache_dtype != "auto":
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r} with a profile: the "
                              f"profile's step costs were measured in its model's dtype (vmemkv "
                              f"calibrate times no other); leave it auto, or simulate that cache "
                              f"on the roofline (no profile)")
        profiled = profile_model(load_profile(self.profile)).name   # default, or the same:
        if self.model not in ("llama-3-8b", profiled):   # the profile's model ran as this one
            raise ConfigError(f"model {self.model!r} with a profile of {profiled!r}: the "
                              f"profile's model is simulated; leave model out")
        for name, value, default in (("prefill_mfu", self.prefill_mfu, None),
                                     ("paged_slowdown", self.paged_slowdown, 1.0),
                                     ("device", self.device, "h100")):
            if value != default:
                raise ConfigError(f"{name} {value!r} with a profile: it tunes the roofline, "
                                  f"and the profile's measured step costs replace the roofline; "
                                  f"leave it out, or simulate without the profile")

    def check_copy_bandwidth(self, entries: Sequence = ()) -> None:
        """With a profile and no ``copy_bytes_per_s``, a run that copies K/V on the device
        (copy-on-write after ``n`` > 1 or ``beam_width`` forks; prefix hits of ``entries``
        with hash ids) on a policy that copies (paged, vmem, a custom class): ConfigError
        naming it. Without a profile it defaults to half the device's memory bandwidth; a
        profile measured no copy bandwidth, and its copies would silently cost 0 s."""
        if self.profile is None or self.copy_bytes_per_s is not None \
                or not (is_custom(self.policy) or self.pool_base is not None):
            return
        copies = (f"n {self.n} (copy-on-write after its forks)" if self.n > 1 else
                  f"beam_width {self.beam_width} (copy-on-write after its forks)"
                  if self.beam_width else "entries with hash ids (their prefix hits are copied)"
                  if any(e.hash_ids for e in entries) else None)
        if copies:
            raise ConfigError(f"copy_bytes_per_s None with profile {self.profile!r} and "
                              f"{copies}: the profile measured no device copy bandwidth (the "
                              f"default, half the device's memory bandwidth, needs a device), "
                              f"so every copy would cost 0 s; give copy_bytes_per_s")

    @property
    def model_spec(self) -> ModelSpec:
        """The model memory is sized for: the profile's when there is one, else ``model``'s."""
        if self.profile:
            return profile_model(load_profile(self.profile))
        return with_kv_cache_dtype(get_model(self.model), self.kv_cache_dtype)

    @property
    def resolved_layout(self) -> str:
        """``layout`` with ``auto`` resolved for this model and page (geometry.resolve_layout)."""
        return resolve_layout(self.layout, self.model_spec, self.page_bytes, on_cuda=True)

    @property
    def pool_units(self) -> int:
        """Pages (vmem) or blocks (paged) the manager's tables keep, for the memory check
        (sim_memory.py), before it is built. A custom class that subclasses the paged or vmem
        manager is counted as its base, at this config's ``block_size`` or ``page_bytes`` (a
        class that hands its base other sizes is counted at these); 0 for the reserve
        policies (tables per sequence) and for other custom classes (their tables are their
        own: not checked)."""
        if self.pool_base is PagedManager:     # a block of one block group's layers
            spec = self.model_spec
            block_bytes = (self.block_size * 2 * len(block_groups(spec)[0].layers)
                           * spec.layer_bytes_per_token)
            return int(self.cache_bytes) // max(1, block_bytes)
        return int(self.cache_bytes) // max(1, self.page_bytes) \
            if self.pool_base is VmemManager else 0

    @property
    def pool_base(self) -> Optional[type]:
        """PagedManager or VmemManager when the policy is one of them or subclasses one."""
        if is_custom(self.policy):
            cls = load_policy_class(self.policy)
            return next((base for base in (VmemManager, PagedManager) if issubclass(cls, base)),
                        None)
        return {"paged": PagedManager, "vmem": VmemManager}.get(self.policy)

    def _options(self) -> dict:
        """The keywords every manager is built with (a custom one too: policies.py)."""
        options = dict(block_size_tokens=self.block_size, page_bytes=self.page_bytes,
                       layout=self.resolved_layout, swap_bytes=int(self.swap_bytes))
        if self.adapter_budget_bytes is not None:
            options["adapter_budget_bytes"] = self.adapter_budget_bytes
        return options

    def make_manager(self) -> MemoryManager:
        """The manager ``policy`` names; a custom class that raises while it is built is a
        PolicyError naming it. ConfigError for a swap run (``scheduler.preemption`` "swap")
        on a manager with no host swap space: every preemption would silently recompute."""
        from .managers import make_manager
        options = self._options()
        if is_custom(self.policy):               # its signature was checked when made
            cls = load_policy_class(self.policy)
            with policy_blamed(self.policy, cls):
                manager = cls(self.model_spec, int(self.cache_bytes), self.max_seq_len, **options)
        else:
            manager = make_manager(self.policy, self.model_spec, int(self.cache_bytes),
                                   self.slot_tokens, max_slots=None,
                                   prefix_eviction=self.prefix_eviction,
                                   hybrid_parts=self.hybrid_parts,
                                   prefix_block_tokens=self.prefix_block_tokens, **options)
        self._check_swap_space(manager)
        return manager

    def _check_swap_space(self, manager: MemoryManager) -> None:
        """Swap preemption needs swap space the manager holds (``swap_bytes``: a subclass of a
        built-in manager must pass it on to its base; a manager of another kind is trusted)."""
        if self.scheduler.preemption != "swap" or not isinstance(manager, ManagerCore) \
                or manager.swap_bytes > 0:
            return
        dropped = (f"; swap_bytes is {int(self.swap_bytes):,} here, and the class does not pass "
                   f"it on to its base (swap_bytes=options['swap_bytes'])"
                   if self.swap_bytes and is_custom(self.policy) else "; give swap_bytes > 0")
        raise ConfigError(f"preemption 'swap' with policy {self.policy!r}: its manager has no "
                          f"host swap space (swap_bytes 0), so every preemption would "
                          f"silently recompute{dropped}")

    def policy_name(self, manager: MemoryManager) -> str:
        """The policy a result is labelled with: the manager's ``name``; for a custom class
        that keeps a built-in's name (inherited, not set), its spec."""
        if is_custom(self.policy) and manager.name in POLICIES + (MemoryManager.name,):
            return self.policy
        return manager.name

    @property
    def slot_tokens(self) -> int:
        """The manager's longest sequence: ``max_seq_len``, rounded up to whole pages on vmem
        (the engine builds its slots so, and still admits only ``max_seq_len``)."""
        if self.policy != "vmem":
            return self.max_seq_len
        return PageGeometry.of(self.model_spec, self.page_bytes, self.resolved_layout) \
            .round_up_tokens(self.max_seq_len)

    def scheduler_for(self, manager: MemoryManager) -> SchedulerConfig:
        """The scheduler config with ``watermark_scope`` applied to ``manager``'s policy; it
        admits ``max_seq_len`` tokens a sequence whatever the manager's slots hold."""
        config = self.scheduler
        if config.max_seq_len is None and self.slot_tokens != self.max_seq_len:
            config = replace(config, max_seq_len=self.max_seq_len)
        if self.watermark_scope == "growing" and manager.holds_final_length:
            return replace(config, watermark=0.0)
        return config

    def make_cost(self, pages_per_map_op: int = 1):
        """The cost model (CostModel, or ProfileCost with ``profile``); ``pages_per_map_op`` is
        the manager's (vmem: pages per group)."""
        if self.profile:
            return profile_cost(load_profile(self.profile), self.map_latency_s, pages_per_map_op)
        return CostModel(self.model_spec, get_device(self.device), prefill_mfu=self.prefill_mfu,
                         map_latency_s=self.map_latency_s, pages_per_map_op=pages_per_map_op,
                         kv_slowdown=self.paged_slowdown if self.pool_base is PagedManager
                         else 1.0)   # a subclass of the paged manager reads its blocks too


def copy_seconds(copied_bytes: int, copy_bytes_per_s: Optional[float]) -> float:
    """Seconds to copy ``copied_bytes`` of K/V on the device at ``copy_bytes_per_s``;
    ConfigError naming it when it is None (a cost model with no device, as a profile's, and no
    bandwidth given): charging the copy 0 s would be silently wrong."""
    if copy_bytes_per_s is None:
        raise ConfigError(f"copy_bytes_per_s None, and the run copied {copied_bytes:,} bytes of "
                          f"K/V on a cost model with no device (a profile) to default it from: "
                          f"give copy_bytes_per_s")
    return copied_bytes / copy_bytes_per_s


def check_deployment(*, model: str, gpu: str, cache_gb: float, preemption: str, swap_gb: float,
                     policy: str, block_size: int, max_len: int, profile: Optional[str] = None,
                     name: Callable[[str], str] = str) -> None:
    """Refuse what the cost model would accept silently but no machine could run: a cache that
    with the weights exceeds the GPU's memory (unless a profile measured the device), swap
    preemption without swap space (it would silently recompute), a block longer than any
    sequence. ``vmemkv simulate`` and every point of ``vmemkv sweep`` run it; ConfigError names
    each setting as ``name(key)`` writes it (a flag, a spec key), the values and the limits."""
    device, spec = get_device(gpu), get_model(model)
    if profile is None and cache_gb * 1e9 + spec.weight_bytes > device.memory_bytes:
        raise ConfigError(
            f"{name('cache_gb')} {cache_gb:g} plus {spec.name}'s {spec.weight_bytes / 1e9:.1f} GB "
            f"of weights exceeds {device.name}'s {device.memory_bytes / 1e9:.1f} GB of memory; "
            f"at most {name('cache_gb')} {(device.memory_bytes - spec.weight_bytes) / 1e9:.1f} fits")
    if preemption == "swap" and swap_gb <= 0:
        raise ConfigError(f"{name('preemption')} swap needs host swap space: give "
                          f"{name('swap_gb')} > 0")
    if policy == "paged" and block_size > max_len:
        raise ConfigError(f"{name('block_size')} {block_size} tokens is longer than "
                          f"{name('max_len')} {max_len}: a block holds at most one sequence's "
                          f"tokens")


@contextmanager
def policy_blamed(spec: str, cls: type, manager: Optional[MemoryManager] = None,
                  running: Callable[[], Iterable[int]] = tuple) -> Iterator[None]:
    """Re-raise what custom policy ``spec`` (class ``cls``) raises inside as a PolicyError
    naming it, the method and the exception with its file:line in the policy's code: while
    ``cls`` is built (``manager`` None: its ``__init__``), or while ``manager`` runs. In a
    run, a ConfigError or RequestTooLargeError names the value to change and passes unchanged;
    but a request too large while the manager counts more live tokens than the sequences
    ``running()`` (the scheduler's, by id) hold is the policy's: its ``free`` kept memory."""
    try:
        yield
    except PolicyError:
        raise
    except Exception as error:  # noqa: BLE001 -- the user's code: any type at all
        if manager is not None and isinstance(error, (ConfigError, RequestTooLargeError)):
            kept = _unreleased_tokens(manager, running()) \
                if isinstance(error, RequestTooLargeError) else 0
            if not kept:
                raise
            raise PolicyError(
                f"custom policy {spec!r}: its stats() count {kept:,} live tokens more than the "
                f"running sequences hold: {cls.__name__}.free kept the memory of sequences "
                f"that ended or were preempted; the run then failed with "
                f"{type(error).__name__}: {error}") from error
        raise PolicyError(f"custom policy {spec!r}: {_blamed_call(cls, manager, error)}") from error


def _unreleased_tokens(manager: MemoryManager, running: Iterable[int]) -> int:
    """Live tokens ``manager`` counts beyond those of the ``running`` sequences (0 for a
    manager that frees what it is told to, or one whose own calls fail here)."""
    try:
        return max(0, manager.stats().live_tokens - sum(map(manager.num_tokens, running)))
    except Exception:  # noqa: BLE001 -- the user's code: blame what it raised first
        return 0


def _blamed_call(cls: type, manager: Optional[MemoryManager], error: Exception) -> str:
    """"Class.method raised Type: message (file.py:line)": the method is the outermost frame
    running on ``manager`` (``__init__`` while it is built), the line the innermost in the
    policy's own files; code it inherits from this package is named as such."""
    frames = list(traceback.walk_tb(error.__traceback__))
    method = "__init__" if manager is None else next(
        (frame.f_code.co_name for frame, _ in frames if frame.f_locals.get("self") is manager),
        None)
    own = _policy_files(cls)
    mine = [(f, line) for f, line in frames if os.path.realpath(f.f_code.co_filename) in own]
    raised = f"{type(error).__name__}: {error}"
    frame, line = (mine or frames)[-1]        # frames: at least this module's own
    where = f"{frame.f_code.co_filename}:{line}" if mine else \
        f"{_package_path(frame.f_code.co_filename)}:{line}, no line of the policy's own code " \
        f"in the traceback"
    if method is None:
        return (f"the run raised {raised} ({where}) outside {cls.__name__}'s methods: a value "
                f"one of them returned breaks what MemoryManager's docstrings promise")
    return f"{cls.__name__}.{method} raised {raised} ({where})"


def _policy_files(cls: type) -> set:
    """Real paths of the source files of ``cls`` and of its bases below MemoryManager that
    are not this package's: the policy's own code."""
    package = os.path.dirname(os.path.realpath(__file__))
    mro = cls.__mro__
    files = set()
    for base in mro[:mro.index(MemoryManager)]:      # load_policy_class: a subclass
        try:
            path = os.path.realpath(inspect.getsourcefile(base) or "")
        except TypeError:        # a class with no source file
            continue
        if not path.startswith(package + os.sep):
            files.add(path)
    return files


def _package_path(path: str) -> str:
    """``path`` relative to the folder above this package (``scheduler/managers/paged.py``)."""
    return os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
