"""EngineConfig: the cache, scheduling and backend choices of one Engine, validated up front."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.hf.support import kv_shape_of, layer_windows_of
from vmemkv.runtime.kv import full_length_tokens, vmem_geometry, vmem_only_given
from vmemkv.runtime.kv_calibration import calibrated_kv_scales
from vmemkv.runtime.kv_dtype import (KV_CACHE_DTYPE_BYTES, KV_CACHE_DTYPES, KVScales,
                                     checkpoint_kv_scales, kv_encoding)
from vmemkv.runtime.memory import bytes_from_fraction, check_fits_device
from vmemkv.scheduler.geometry import LAYOUT_CHOICES, LAYOUTS, resolve_layout  # noqa: F401 (LAYOUTS re-exported)
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.managers.eviction import DEFAULT_EVICTION, EVICTION_POLICIES

from .errors import EngineConfigError
from .logprobs import step_logits_bytes

CACHES = ("vmem", "paged")
PREEMPTION = ("recompute", "swap")
MIN_TP_TIMEOUT_S = 0.001   # torch waits whole milliseconds; 0 ms is its "no timeout"


@dataclass(frozen=True)
class EngineConfig:
    """Every field is checked in ``__post_init__``; sizes are in tokens unless named ``_bytes``."""
    cache: str = "vmem"                  # "vmem" (contiguous per request) or "paged" (blocks)
    layout: str = "per-layer"            # vmem: "per-layer", "interleaved" (all layers per page)
                                         # or "auto" (resolved at construction: resolve_layout)
    page_bytes: Optional[int] = None     # vmem page size (paged: None only); None: 2 MiB on
                                         # CUDA, on the host the least multiple of 64 KiB
                                         # holding whole tokens
    block_size: int = 16                 # paged: tokens per block; vmem: prefix-hit block
    max_batch: int = 8                   # sequences running at once (vmem: slots)
    max_context: int = 1024              # tokens per sequence, prompt + output (vmem: rounded
                                         # up to whole pages)
    cache_bytes: Optional[int] = None    # device bytes for K/V; None: max_batch full sequences
    memory_utilization: Optional[float] = None  # or: this fraction of the device's AVAILABLE
                                         # memory (host MemAvailable, CUDA free) goes to K/V, in
                                         # (0, 1]; exclusive with cache_bytes
    max_cache_bytes: Optional[int] = None  # vmem: the most resize_cache (or a MemoryBudget)
                                         # may grow the pool to, its page ids reserved now; None:
                                         # the initial budget (a MemoryBudget's total with one)
    min_cache_bytes: Optional[int] = None  # with a MemoryBudget: the bytes reserved for this
                                         # engine whatever the others do; None: the initial
    max_tokens_per_step: int = 2048      # new tokens per step (prefill chunking budget)
    attention: Optional[str] = None      # backend name; None: fastest for the layout and device
    preemption: str = "recompute"        # when a running sequence cannot grow: recompute | swap
    swap_bytes: int = 0                  # host swap space for preemption="swap" (only)
    watermark: float = 0.0               # fraction of the cache admission keeps free
    prefix_sharing: bool = False         # share cached prompt prefixes across requests (opt-in:
                                         # hashing every prompt costs time when nothing repeats)
    prefix_eviction: str = DEFAULT_EVICTION   # with prefix_sharing: keep computed prefixes after
                                         # their requests end, evicting lru (vLLM's order) or
                                         # hits (often-shared last); "off" keeps none
    background_mapper: bool = False      # vmem only: map pages on a thread, overlapping compute
    seed: int = 0                        # seeds the generators of requests without a seed
    check_integrity: bool = False        # run the manager's integrity check after every step
    max_plan_retries: int = 3            # a failed memory plan is retried this many times in a
                                         # row before generate() raises PlanExecutionError
    self_check: bool = True              # at construction, check a short prompt's logits on our
                                         # attention against the model's own; False is UNSAFE (an
                                         # unverified architecture may give wrong tokens silently)
    tensor_parallel_size: int = 1        # ranks (processes) sharing the model by heads (CPU: gloo;
                                         # CUDA: one GPU per rank, activations over NCCL)
    tp_launch: str = "spawn"             # "spawn": the engine starts ranks 1..N-1; "env": torchrun did
    tp_devices: Optional[tuple] = None   # CUDA, spawn: rank r's device ("cuda:i"), the model's
                                         # device first; None: the model's, then the other GPUs
    tp_timeout_s: float = 60.0           # a step's collectives wait at most this for a rank
    kv_cache_dtype: str = "auto"         # how K/V are stored: auto (the model's dtype), bf16,
                                         # fp16, fp8_e4m3, fp8_e5m2, int8 (runtime/kv_dtype.py)
    kv_scales: Union[KVScales, str, None] = None  # 8-bit: per (layer, KV head) scales of K and
                                         # V; None: the checkpoint's, else fixed at each layer's
                                         # first prefill chunk; "calibrate": the checkpoint's, else
                                         # from a fixed text at start-up (runtime/kv_calibration.py)
    # (cache_bytes / memory_utilization are PER RANK with tensor parallelism)

    def __post_init__(self) -> None:
        self._one_of("cache", CACHES)
        self._one_of("layout", LAYOUT_CHOICES)
        self._one_of("preemption", PREEMPTION)
        self._one_of("prefix_eviction", EVICTION_POLICIES)
        self._one_of("kv_cache_dtype", KV_CACHE_DTYPES)
        # a backend name: ["sdpa"] was a raw "unhashable type" TypeError at construction
        if self.attention is not None and not isinstance(self.attention, str):
            raise EngineConfigError(f"EngineConfig.attention must be a backend name (str) or "
                                    f"None, got {type(self.attention).__name__} "
                                    f"{repr(self.attention)[:60]}")
        if isinstance(self.kv_scales, str) and self.kv_scales != "calibrate":
            raise EngineConfigError(f"EngineConfig.kv_scales must be a KVScales, None or "
                                    f"'calibrate', got {self.kv_scales!r}")
        if self.kv_scales is not None and KV_CACHE_DTYPE_BYTES[self.kv_cache_dtype] != 1:
            raise EngineConfigError(f"EngineConfig.kv_scales apply to fp8_e4m3, fp8_e5m2 and int8 "
                                    f"only; kv_cache_dtype is {self.kv_cache_dtype!r}")
        for name, low in (("block_size", 1), ("max_batch", 1), ("max_context", 2),
                          ("max_tokens_per_step", 1), ("swap_bytes", 0), ("seed", 0),
                          ("max_plan_retries", 0), ("tensor_parallel_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise EngineConfigError(f"EngineConfig.{name} must be an int >= {low}, got {value!r}")
        check_block_size(self.cache, self.block_size, self.max_context)
        if self.min_cache_bytes is not None and (isinstance(self.min_cache_bytes, bool) or not
                                                 isinstance(self.min_cache_bytes, int) or
                                                 self.min_cache_bytes < 0):
            raise EngineConfigError(f"EngineConfig.min_cache_bytes must be an int >= 0 or None, "
                                    f"got {self.min_cache_bytes!r}")
        for name in ("page_bytes", "cache_bytes", "max_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EngineConfigError(f"EngineConfig.{name} must be an int >= 1 or None, got {value!r}")
        if self.max_tokens_per_step < self.max_batch:
            raise EngineConfigError(f"EngineConfig.max_tokens_per_step must be >= max_batch "
                                    f"({self.max_batch}) so every decode fits a step, got "
                                    f"{self.max_tokens_per_step}")
        if (not isinstance(self.watermark, (int, float)) or isinstance(self.watermark, bool)
                or not 0.0 <= self.watermark < 1.0):
            raise EngineConfigError(f"EngineConfig.watermark must be in [0, 1), got {self.watermark!r}")
        self._check_memory_utilization()
        if self.cache != "vmem" and (self.max_cache_bytes, self.min_cache_bytes) != (None, None):
            raise EngineConfigError(f"EngineConfig.max_cache_bytes / min_cache_bytes need "
                                    f"cache='vmem' (only its pool resizes), got {self.cache!r}")
        if None not in (self.max_cache_bytes, self.cache_bytes) and \
                self.max_cache_bytes < self.cache_bytes:
            raise EngineConfigError(f"EngineConfig.max_cache_bytes ({self.max_cache_bytes}) is "
                                    f"below cache_bytes ({self.cache_bytes})")
        for name in ("cache_bytes", "max_cache_bytes"):   # what a MemoryBudget share starts at
            limit = getattr(self, name)                    # and may reach
            if None not in (limit, self.min_cache_bytes) and self.min_cache_bytes > limit:
                raise EngineConfigError(f"EngineConfig.min_cache_bytes ({self.min_cache_bytes}) "
                                        f"is above {name} ({limit})")
        for name in ("self_check", "prefix_sharing", "background_mapper", "check_integrity"):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(f"EngineConfig.{name} must be True or False, got "
                                        f"{getattr(self, name)!r}")
        if self.preemption == "swap" and self.swap_bytes == 0:
            raise EngineConfigError("EngineConfig.swap_bytes must be > 0 when preemption='swap'")
        if self.preemption != "swap" and self.swap_bytes > 0:
            raise EngineConfigError(f"EngineConfig.swap_bytes ({self.swap_bytes}) is the host "
                                    f"swap space of preemption='swap'; with preemption="
                                    f"{self.preemption!r} no sequence swaps and it would only be "
                                    f"held aside: set preemption='swap' or swap_bytes=0")
        self._check_applies()
        self._check_tensor_parallel()

    def _check_applies(self) -> None:
        """An option given where it does nothing (it was accepted and ignored) is refused by
        name, as ``vmemkv generate`` refuses its flag (generate_checks._check_applies)."""
        if self.prefix_eviction != DEFAULT_EVICTION and not self.prefix_sharing:
            raise EngineConfigError(f"EngineConfig.prefix_eviction {self.prefix_eviction!r} "
                                    f"applies with prefix_sharing=True only (no prefix is kept "
                                    f"without it): set prefix_sharing=True or drop it")
        ignored = vmem_only_given(self.cache, layout=self.layout, page_bytes=self.page_bytes,
                                  background_mapper=self.background_mapper)
        if ignored:   # (max_cache_bytes / min_cache_bytes: refused above, naming both)
            name, value = next(iter(ignored.items()))
            raise EngineConfigError(f"EngineConfig.{name} {value!r} applies to cache='vmem' "
                                    f"only; with cache='paged' it would do nothing: drop it")

    def _check_tensor_parallel(self) -> None:
        self._one_of("tp_launch", ("spawn", "env"))
        timeout = self.tp_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not MIN_TP_TIMEOUT_S <= timeout < 1e6:
            raise EngineConfigError(f"EngineConfig.tp_timeout_s must be seconds in [0.001, 1e6) "
                                    f"(torch counts whole milliseconds), got {timeout!r}")
        if self.tensor_parallel_size > 1 and self.background_mapper:
            raise EngineConfigError("EngineConfig.background_mapper is not supported with "
                                    f"tensor_parallel_size {self.tensor_parallel_size} (every rank "
                                    f"applies each plan inline so that all or none do)")

    def _check_memory_utilization(self) -> None:
        value = self.memory_utilization
        if value is None:
            return
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not 0.0 < value <= 1.0):   # also refuses nan
            raise EngineConfigError(f"EngineConfig.memory_utilization must be a fraction in "
                                    f"(0, 1] or None, got {value!r}")
        if self.cache_bytes is not None:
            raise EngineConfigError(f"EngineConfig.cache_bytes ({self.cache_bytes}) and "
                                    f"memory_utilization ({value}) are exclusive; give one")

    def _one_of(self, name: str, allowed: tuple) -> None:
        if getattr(self, name) not in allowed:
            raise EngineConfigError(f"EngineConfig.{name} must be one of {', '.join(allowed)}, "
                                    f"got {getattr(self, name)!r}")


def check_block_size(cache: str, block_size: int, max_context: int,
                     names: tuple = ("EngineConfig.block_size", "max_context"),
                     error: type = EngineConfigError) -> None:
    """A paged block holds at most one sequence's tokens: ``error`` naming ``names`` (the two
    fields, or the CLI's flags) when ``block_size`` is longer than ``max_context`` (the API
    blamed cache_bytes, which nobody gave, or CacheConfig.max_context). A vmem cache's
    block_size is only its prefix-hit granularity, not checked here."""
    if cache == "paged" and block_size > max_context:
        raise error(f"{names[0]} {block_size} tokens is longer than {names[1]} {max_context}: "
                    f"a block holds at most one sequence's tokens")


def cache_budget_bytes(cfg: EngineConfig, cache_config, vocab_size: int) -> int:
    """The K/V budget of an engine in bytes: ``cache_bytes``, else ``memory_utilization`` of the
    device's available memory, else room for every slot at full length. Checked against the
    device's total and available memory (CacheTooLargeError) before anything is built, alone
    and beside the working memory of one step's logits (``logprobs.step_logits_bytes``:
    ``max_tokens_per_step`` rows of ``vocab_size`` fp32 logits when every new token is a prompt
    row whose logprobs are asked, the sampled rows' copy and the slice being scored)."""
    device = cache_config.torch_device
    if cfg.memory_utilization is not None:
        budget = bytes_from_fraction(cfg.memory_utilization, device)
        what = (f"the engine's KV cache ({budget} bytes: "
                f"memory_utilization={cfg.memory_utilization})")
    else:
        budget = cfg.cache_bytes
        what = f"the engine's KV cache (cache_bytes={budget})"
        if budget is None:
            c = cache_config
            budget = c.max_batch * full_length_tokens(c.max_context, cfg.cache, cfg.block_size) \
                * c.bytes_per_token
            what = (f"the engine's KV cache ({cache_config.max_batch} slots of "
                    f"{cache_config.max_context} tokens; cache_bytes=None)")
        check_fits_device(what, budget, device)
    logits_bytes = step_logits_bytes(cfg.max_tokens_per_step, cfg.max_batch, vocab_size)
    check_fits_device(f"{what} beside one step's logits ({logits_bytes} bytes: "
                      f"max_tokens_per_step={cfg.max_tokens_per_step} rows of a {vocab_size}-token "
                      f"vocabulary in fp32, and their scoring)", budget + logits_bytes, device,
                      remedy="lower cache_bytes (or memory_utilization) or max_tokens_per_step")
    return budget


def resolved_layout(cfg: "EngineConfig", cache_config) -> "EngineConfig":
    """``cfg`` with ``layout="auto"`` resolved for ``cache_config``'s model and the page size
    (scheduler.geometry.resolve_layout); any other layout as it is."""
    if cfg.layout != "auto":
        return cfg
    layout = resolve_layout(cfg.layout, cache_config, cfg.page_bytes,
                            on_cuda=cache_config.torch_device.type == "cuda")
    return replace(cfg, layout=layout)


def page_rounded_context(cache_config, cfg, tokens: int) -> int:
    """Smallest context >= ``tokens`` a cache of ``cfg`` can be built with (vmem: whole pages
    per slot; paged: any). The engine still admits only the user's ``max_context``."""
    if CacheKind(cfg.cache) is not CacheKind.VMEM:
        return tokens
    return vmem_geometry(cache_config, cfg.layout, cfg.page_bytes).round_up_tokens(tokens)


def check_engine_arguments(model, config) -> None:
    """Typed errors for the wrong things passed to Engine(model, config=...)."""
    import torch
    if not isinstance(model, torch.nn.Module):
        hint = (f"; build it first, e.g. vmemkv.runtime.models.build_model({model!r})"
                if isinstance(model, str) else "")
        raise EngineConfigError(f"Engine needs a torch causal-LM module (e.g. LlamaForCausalLM) as "
                                f"its model, got {type(model).__name__} {str(model)[:60]!r}{hint}")
    if not hasattr(getattr(model, "config", None), "get_text_config"):
        raise EngineConfigError(f"Engine needs a transformers causal LM (a module with a "
                                f".config); got {type(model).__name__}")
    if config is not None and not isinstance(config, EngineConfig):
        raise EngineConfigError(f"Engine config must be an EngineConfig, got "
                                f"{type(config).__name__} {str(config)[:60]}; pass options as "
                                f"keywords (Engine(model, **options)) or EngineConfig(**options)")


def kv_scales_for(model, tokenizer, cfg: EngineConfig, param) -> tuple:
    """(scales, source) of the engine's cache: for an 8-bit ``kv_cache_dtype`` the user's
    ``kv_scales`` ("user"), else the checkpoint's ("checkpoint"), else with ``"calibrate"``
    those of the calibration input ("calibrated", runtime/kv_calibration.py), else None: fixed
    at each layer's first write ("first-write"). (None, None) for an unscaled encoding."""
    encoding = kv_encoding(cfg.kv_cache_dtype, param.dtype)
    if not encoding.scaled:
        return None, None
    if cfg.kv_scales is not None and not isinstance(cfg.kv_scales, str):
        return cfg.kv_scales, "user"
    kv = kv_shape_of(model.config.get_text_config())
    shape = (kv["num_layers"], kv["num_kv_heads"])
    found = checkpoint_kv_scales(model, encoding, *shape)
    if found is not None:
        return found, "checkpoint"
    if cfg.kv_scales == "calibrate":
        return calibrated_kv_scales(model, tokenizer, encoding, *shape, cfg.max_context), \
            "calibrated"
    return None, "first-write"


def cache_config_for(model, cfg: EngineConfig, param, kv_heads: Optional[int] = None,
                     scales=None) -> CacheConfig:
    """The cache's shape an engine config gives ``model`` (``param``: one of its parameters, for
    the dtype and device); ``kv_heads``: one tensor-parallel rank's share of the KV heads;
    ``scales``: 8-bit scales (``kv_scales_for``), None: fixed at first write."""
    mc = model.config.get_text_config()
    kv = kv_shape_of(mc)
    shape = dict(**kv, dtype=param.dtype, device=str(param.device),
                 max_batch=cfg.max_batch, layer_windows=layer_windows_of(mc),
                 kv_cache_dtype=cfg.kv_cache_dtype, kv_scales=scales)
    if kv_heads is not None:
        shape["num_kv_heads"] = kv_heads
    # a vmem slot is whole pages: the cache is built rounded up, admission uses max_context
    probe = CacheConfig(**shape, max_context=cfg.max_context)
    cfg = resolved_layout(cfg, probe)
    check_prefix_blocks(cfg, probe)
    return CacheConfig(**shape, max_context=page_rounded_context(probe, cfg, cfg.max_context))


def check_prefix_blocks(cfg: EngineConfig, cache_config) -> None:
    """vmem prefix hits are found in ``block_size``-token blocks of a page (not behind a
    window: every layer windowed, or a hybrid's windowed kind in the per-layer layout): a
    block size that does not divide a page's tokens would leave only whole pages findable,
    silently, so it is refused naming both (``cfg``'s layout resolved)."""
    windows = [w for w in cache_config.layer_windows if w is not None]
    behind_window = bool(windows) and (len(windows) == len(cache_config.layer_windows)
                                       or cfg.layout == "per-layer")
    if cfg.cache != "vmem" or not cfg.prefix_sharing or behind_window:
        return
    tokens_per_page = vmem_geometry(cache_config, cfg.layout, cfg.page_bytes).tokens_per_page
    if tokens_per_page > cfg.block_size and tokens_per_page % cfg.block_size:
        dividing = next(d for d in range(cfg.block_size, 0, -1) if not tokens_per_page % d)
        raise EngineConfigError(
            f"EngineConfig.block_size {cfg.block_size} does not divide a vmem page's "
            f"{tokens_per_page} tokens ({cfg.layout} layout): prefix hits are found in blocks of "
            f"block_size tokens of a page, and with this one only whole pages would be: give a "
            f"block_size that divides {tokens_per_page} (e.g. {dividing})")


def attention_needs(model, cache_config) -> dict:
    """What an attention backend must take for ``model`` (``fastest_backend``'s keywords): its
    query heads per KV head (``group``, of its cache's KV heads) and its layers' ``features``:
    a sliding window, transformers' ``attn_logit_softcapping`` (flash-attn has neither: it was
    picked for Mistral and Gemma 2, and every windowed or capped layer was refused)."""
    text = model.config.get_text_config()
    features = {"window"} if any(w is not None for w in cache_config.layer_windows) else set()
    if getattr(text, "attn_logit_softcapping", None):   # a transformers config field
        features.add("softcap")
    return {"group": text.num_attention_heads // cache_config.num_kv_heads,
            "features": frozenset(features)}
