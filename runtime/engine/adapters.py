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

Host copies are kept while a name refers to them or a live request runs with them.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Dict, Iterable, Optional

from vmemkv.scheduler.adapters import AdapterRef
from vmemkv.scheduler.plan import EvictAdapter, LoadAdapter

from .errors import EngineConfigError, RequestRejectedError


class EngineAdapters:
    """Adapters by name and by digest for one engine's model and cache."""

    def __init__(self, model, manager, in_use: Callable[[], Iterable[str]]) -> None:
        self._model = model
        self._manager = manager
        self._in_use = in_use            # digests live requests run with (the engine's)
        self._slots = None               # runtime.lora.LoraSlots, attached on the first add
        self._by_name: Dict[str, object] = {}     # name -> LoraAdapter
        self._by_digest: Dict[str, object] = {}   # digest -> LoraAdapter (named or in use)
        self._views: Dict[str, tuple] = {}        # digest -> (buffer address, AdapterWeights)
        self.loads = 0                   # LoadAdapter ops executed (weights written)
        self._orphans = False            # host copies kept only for live requests

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    @property
    def names(self) -> list:
        return sorted(self._by_name)

    def add(self, name: str, path, replace: bool = False) -> AdapterRef:
        """Load ``path`` under ``name``; refused by name (nothing changed) when the name is
        taken (unless ``replace``), the files are not a supported adapter, or its weights could
        never fit in this cache's pool."""
        from vmemkv.runtime.lora import LoraAdapter, attach_lora
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise EngineConfigError(f"add_lora: name must be a str of 1-256 characters, got "
                                    f"{name!r}")
        if name in self._by_name and not replace:
            raise EngineConfigError(f"add_lora: an adapter named {name!r} is loaded; "
                                    f"remove_lora({name!r}) first, or pass replace=True")
        adapter = LoraAdapter.load(path, self._model)
        ref = AdapterRef(name, adapter.digest, adapter.num_bytes)
        pages = self._manager.adapter_pages(ref.num_bytes)
        most = self._manager.max_adapter_pages()
        if pages > most:
            raise EngineConfigError(
                f"add_lora: adapter {name!r} needs {ref.num_bytes} bytes ({pages} pool pages), "
                f"more than this cache can ever give adapters ({most} pages); build the engine "
                f"with a larger cache_bytes")
        if self._slots is None:
            self._slots = attach_lora(self._model)
        old = self._by_name.get(name)
        self._by_name[name] = adapter
        self._by_digest.setdefault(adapter.digest, adapter)
        if old is not None:
            self.collect()
        return ref

    def remove(self, name: str) -> None:
        """Forget ``name``; requests already running with it finish with it."""
        if name not in self._by_name:
            raise EngineConfigError(f"remove_lora: no adapter named {name!r} (loaded: "
                                    f"{self.names or 'none'})")
        del self._by_name[name]
        self.collect()

    def collect(self) -> None:
        """Drop host copies nothing names and no live request runs with (each step does while
        a removed or replaced adapter's requests are still live)."""
        named = {a.digest for a in self._by_name.values()}
        keep = named | set(self._in_use())
        for digest in [d for d in self._by_digest if d not in keep]:
            del self._by_digest[digest]
        self._orphans = bool(set(self._by_digest) - named)

    def ref(self, name: Optional[str], index: int = 0) -> Optional[AdapterRef]:
        """The request's AdapterRef; RequestRejectedError naming ``lora`` when unknown."""
        if name is None:
            return None
        adapter = self._by_name.get(name)
        if adapter is None:
            raise RequestRejectedError(f"prompt {index} rejected: SamplingParams.lora names no "
                                       f"loaded adapter: {name!r} (loaded: {self.names or 'none'})",
                                       index)
        return AdapterRef(name, adapter.digest, adapter.num_bytes)

    # ---- executor side: the model runner calls these each step ----------------------------
    def apply(self, ops, cache) -> None:
        """After a plan's ops ran: write each loaded adapter's weights into its pool pages."""
        if self._orphans:
            self.collect()
        for op in ops:
            if isinstance(op, LoadAdapter):
                adapter = self._by_digest.get(op.adapter_id)
                if adapter is None:   # a bug: the scheduler pinned an adapter nobody holds
                    raise EngineConfigError(f"adapter {op.adapter_id[:12]} loaded with no weights")
                adapter.pack_into(cache.adapter_buffer(op.adapter_id))
                self._views.pop(op.adapter_id, None)
                self.loads += 1
            elif isinstance(op, EvictAdapter):
                self._views.pop(op.adapter_id, None)

    def batch(self, seqs, cache):
        """A context running the step's rows with their adapters (nullcontext when none)."""
        if self._slots is None or not any(s.adapter_id for s in seqs):
            return nullcontext()
        from vmemkv.runtime.lora import LoraBatch
        segments, row = [], 0
        for s in seqs:
            end = row + s.num_new_tokens
            if s.adapter_id is not None:
                segments.append((row, end, self._weights(s.adapter_id, cache)))
            row = end
        return self._slots.batch(LoraBatch(segments))

    def _weights(self, digest: str, cache):
        buffer = cache.adapter_buffer(digest)
        known = self._views.get(digest)
        if known is None or known[0] != buffer.data_ptr():
            known = self._views[digest] = (buffer.data_ptr(),
                                           self._by_digest[digest].views(buffer))
        return known[1]

    def gauges(self) -> dict:
        """/metrics' adapter figures (runtime/serve/metrics.py names them)."""
        stats = self._manager.adapter_stats()
        return dict(lora_adapters_loaded=len(self._by_name), lora_adapters_resident=stats.resident,
                    lora_adapter_pages=stats.pages, lora_adapter_loads=stats.loads,
                    lora_adapter_evictions=stats.evictions)
