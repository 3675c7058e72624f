"""The engine's LoRA adapters: loaded by name, resident in the KV cache's own pool.

    engine.add_lora("sql", "/adapters/sql")          # PEFT's adapter_config.json + safetensors
    engine.generate(prompts, SamplingParams(lora="sql"))

An adapter is host weights plus an ``AdapterRef`` (name, content digest, bytes). A request
names it; the scheduler pins it while the request runs, and the manager loads it into pool
pages (``LoadAdapter``: the cache maps the pages, this registry writes the weights there) or
evicts it when idle and KV needs the pages (``EvictAdapter``). Each step the model runner asks
for a ``LoraBatch``: the rows of each sequence with the weights of its adapter, read as
zero-copy views of the pool pages (runtime/lora/). Prefix keys carry the digest, so a name
reloaded with other weights never hits the old KV.

Host copies are kept while a name refers to them or a live request runs with them. On an 8-bit
KV cache (``kv_cache_dtype`` fp8_e4m3, fp8_e5m2, int8) an adapter on K or V (k_proj, v_proj, a
fused qkv_proj) is refused: the cache's scales are fixed for the base model's K/V and clipped an
adapter's silently (tiny-llama, lora_alpha 64: its K/V reached 5.1-6.7x the clip point, 1 of fp32's
top-5 first tokens kept). Adapters on q_proj, o_proj and the MLP stay: the K/V they change are
projections of the RMS-normed hidden state, within the base prompts' own range of the scales.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, Optional

from vmemkv.scheduler.adapters import AdapterRef
from vmemkv.scheduler.presets import KV_CACHE_DTYPE_BYTES
from vmemkv.vmem.checks import check_flag

from .errors import EngineConfigError, UnknownAdapterError


class EngineAdapters:
    """Adapters by name and by digest for one engine's model and cache."""

    def __init__(self, model, manager, in_use: Callable[[], Iterable[str]],
                 hooked_model=None, host_copies: int = 1, kv_cache_dtype: str = "auto") -> None:
        from vmemkv.runtime.lora.executor import AdapterExecutor
        self._model = model              # adapters are checked against it (the whole model)
        self._manager = manager
        self._in_use = in_use            # digests live requests run with (the engine's)
        self._by_name: Dict[str, AdapterRef] = {}  # name -> its AdapterRef (bytes: as held)
        self._by_digest: Dict[str, object] = {}   # digest -> LoraAdapter (named or in use)
        self._orphans = False            # host copies kept only for live requests
        self._host_copies = host_copies  # processes holding each adapter (tensor-parallel ranks)
        self._kv_cache_dtype = kv_cache_dtype   # 8-bit: adapters on K/V are refused
        # the forwards run on hooked_model: rank 0's shard under tensor parallelism
        self.executor = AdapterExecutor(hooked_model or model, self.host_copy)

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    @property
    def names(self) -> list:
        return sorted(self._by_name)

    def add(self, name: str, path, replace: bool = False) -> AdapterRef:
        """Load ``path`` under ``name``; refused by name (nothing changed) when the name is
        taken (unless ``replace``), the files are not a supported adapter, or its weights could
        never fit in this cache's pool; a ``path`` that is no str or os.PathLike is a
        LoraConfigError as a missing directory is (3 or None was a raw TypeError)."""
        from vmemkv.runtime.lora import LoraAdapter, LoraConfigError
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise EngineConfigError(f"add_lora: name must be a str of 1-256 characters, got "
                                    f"{name!r}")
        if not isinstance(path, (str, os.PathLike)):
            raise LoraConfigError(f"add_lora: path must be the adapter's directory (a str or "
                                  f"os.PathLike), got {type(path).__name__} {repr(path)[:60]}")
        check_flag(replace, "add_lora: replace", EngineConfigError)   # a truthy "no" replaced
        if name in self._by_name and not replace:
            raise EngineConfigError(f"add_lora: an adapter named {name!r} is loaded; "
                                    f"remove_lora({name!r}) first, or pass replace=True")
        adapter = LoraAdapter.load(path, self._model, host_copies=self._host_copies)
        self._refuse_kv_targets(name, adapter)
        ref = AdapterRef(name, adapter.digest, self.executor.held(adapter).num_bytes)
        self._refuse_too_large(ref)
        old = self._by_name.get(name)
        self._by_name[name] = ref
        self._by_digest.setdefault(adapter.digest, adapter)
        if old is not None:
            self.collect()
        return ref

    def _refuse_too_large(self, ref: AdapterRef) -> None:
        """EngineConfigError naming the adapter when its pages pass what this cache can ever
        give adapters, or leave no room for one token of KV beside it in the largest pool:
        such an adapter loaded, and every request on it was refused (a 404 over HTTP)."""
        manager, size = self._manager, f"{ref.num_bytes} bytes"
        pages, most = manager.adapter_pages(ref.num_bytes), manager.max_adapter_pages()
        if pages > most:
            raise EngineConfigError(
                f"add_lora: adapter {ref.name!r} needs {size} ({pages} pool pages), more than "
                f"this cache can ever give adapters ({most} pages); build the engine with a "
                f"larger cache_bytes")
        if manager.max_sequence_tokens_with_adapter(ref, manager.max_cache_bytes) == 0:
            raise EngineConfigError(
                f"add_lora: adapter {ref.name!r} needs {size} ({pages} pool pages), which leave "
                f"no room for one token of KV beside it in this cache at its largest "
                f"({manager.max_cache_bytes} bytes): no request could run on it; build the "
                f"engine with a larger cache_bytes")

    def _refuse_kv_targets(self, name: str, adapter) -> None:
        """LoraTargetError naming the adapter, its K/V modules and the kv_cache_dtype when the
        cache is 8-bit and the adapter writes K or V (nothing is registered or loaded)."""
        from vmemkv.runtime.lora import LoraTargetError
        modules = adapter.kv_modules
        if not modules or KV_CACHE_DTYPE_BYTES[self._kv_cache_dtype] != 1:
            return
        kinds = sorted({m.rsplit(".", 1)[-1] for m in modules})
        raise LoraTargetError(
            f"add_lora: adapter {name!r} ({adapter.path}) targets {', '.join(kinds)} "
            f"({len(modules)} modules: {modules[0]}, ...), which write K/V, and kv_cache_dtype "
            f"is {self._kv_cache_dtype!r}: its scales are fixed for the base model's K/V and "
            f"would clip this adapter's silently; use an adapter on q_proj, o_proj and the MLP "
            f"only, or a 16-bit kv_cache_dtype")

    def remove(self, name: str) -> None:
        """Forget ``name``; requests already running with it finish with it. EngineConfigError
        naming ``name`` for one that is no str (a list was a raw TypeError) or not loaded."""
        if not isinstance(name, str):
            raise EngineConfigError(f"remove_lora: name must be a str, got "
                                    f"{type(name).__name__} {str(name)[:60]!r}")
        if name not in self._by_name:
            raise EngineConfigError(f"remove_lora: no adapter named {name!r} (loaded: "
                                    f"{self.names or 'none'})")
        del self._by_name[name]
        self.collect()

    def collect(self) -> None:
        """Drop host copies nothing names and no live request runs with (each step does while
        a removed or replaced adapter's requests are still live)."""
        named = {ref.digest for ref in self._by_name.values()}
        keep = named | set(self._in_use())
        for digest in [d for d in self._by_digest if d not in keep]:
            del self._by_digest[digest]
        self._orphans = bool(set(self._by_digest) - named)

    def ref(self, name: Optional[str], index: int = 0) -> Optional[AdapterRef]:
        """The request's AdapterRef; UnknownAdapterError (a RequestRejectedError naming
        ``lora``) when unknown."""
        if name is None:
            return None
        ref = self._by_name.get(name)
        if ref is None:
            raise UnknownAdapterError(f"prompt {index} rejected: SamplingParams.lora names no "
                                      f"loaded adapter: {name!r} (loaded: {self.names or 'none'})",
                                      index, "lora")
        return ref

    # ---- executor side: the model runner calls these each step ----------------------------
    def host_copy(self, digest: str):
        """The LoraAdapter (host weights) with ``digest``, or None."""
        return self._by_digest.get(digest)

    def apply(self, ops, cache) -> None:
        """After a plan's ops ran: write each loaded adapter's weights into its pool pages."""
        if self._orphans:
            self.collect()
        self.executor.apply(ops, cache)

    def batch(self, seqs, cache):
        """A context running the step's rows with their adapters (nullcontext when none)."""
        return self.executor.batch(seqs, cache)

    def gauges(self) -> dict:
        """/metrics' adapter figures (runtime/serve/metrics.py names them)."""
        stats = self._manager.adapter_stats()
        return dict(lora_adapters_loaded=len(self._by_name), lora_adapters_resident=stats.resident,
                    lora_adapter_pages=stats.pages, lora_adapter_loads=stats.loads,
                    lora_adapter_evictions=stats.evictions)
