"""LoRA adapters as the scheduler and the managers see them: a name, a content digest and a size.

    ref = AdapterRef("sql", hashlib.sha256(weights_and_config).hexdigest(), 12_582_912)
    Request(0, prompt_len=8, max_tokens=16, adapter=ref)

An adapter's weights are another TENANT of the page ledger (managers/ledger.py), tenant
``("adapter", digest)``: they take pool pages (vmem) or blocks (paged) from the free list KV
takes from, so adapters and KV share one physical pool (managers/adapters.py). The digest is
the adapter's identity everywhere: the tenant, the ops' ``adapter_id``, and the root of its
requests' prefix keys (``Request.prefix_scope``), so the same name reloaded with other weights
never hits the KV computed under the old ones, and two adapters never share a block. The name
is for messages only.

The scheduler pins a request's adapter while a sequence of it runs: each RUNNING sequence with
an adapter holds one use of it (admitted, swapped in, forked), every way out of RUNNING gives
it back (finished, aborted, failed, preempted to recompute or swapped out); so a manager's use
counts equal the running sequences of each adapter, and an adapter nobody runs with is idle:
resident, evicted when KV or another adapter needs its pages.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .beam_fit import longest_sequence, unit_costs
from .errors import (CacheShrunkError, ConfigError, RequestTooLargeError, SchedulerError,
                     length_field)

_DIGEST = re.compile(r"[0-9a-f]{64}")


class AdapterStateError(SchedulerError, ValueError):
    """An adapter released more often than it was acquired, or a digest seen with two sizes:
    a caller's bug (nothing changed)."""


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter: ``name`` (for messages), ``digest`` (SHA-256 of its weights and config,
    64 hex digits, lower-cased here; what identifies it) and ``num_bytes`` (its weights as the
    runtime packs them into pool memory). Validated: ConfigError naming the field."""
    name: str
    digest: str
    num_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"AdapterRef.name must be a non-empty str, got {self.name!r}")
        digest = self.digest.lower() if isinstance(self.digest, str) else self.digest
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ConfigError(f"AdapterRef.digest of adapter {self.name!r} must be a SHA-256 "
                              f"hex digest (64 hex digits), got {self.digest!r}")
        object.__setattr__(self, "digest", digest)
        if isinstance(self.num_bytes, bool) or not isinstance(self.num_bytes, int) or \
                self.num_bytes < 1:
            raise ConfigError(f"AdapterRef.num_bytes of adapter {self.name!r} must be an int "
                              f">= 1, got {self.num_bytes!r}")

    @property
    def tenant(self) -> tuple:
        """Its tenant in a page ledger."""
        return ("adapter", self.digest)

    def __str__(self) -> str:
        return f"{self.name!r} ({self.digest[:12]}, {self.num_bytes} bytes)"


def check_adapter(value, what: str = "adapter"):
    """``value`` if it is None or an AdapterRef, else ConfigError naming ``what``."""
    if value is not None and not isinstance(value, AdapterRef):
        raise ConfigError(f"{what} must be an AdapterRef or None, got {value!r}")
    return value


def adapter_pool_bytes(scheduler) -> tuple:
    """(The pool size a request's adapter is checked at now, None: the pool as it is; the
    largest it may be resized to; on a MemoryBudget the scheduler's ``reach_note``, else None):
    the keywords of ``check_adapter_fits``. A pool a MemoryBudget resizes is checked at its
    reach (which it grows to on demand; the share's max, less the other shares' minimums), as
    ``Scheduler.fit_tokens`` checks a request without one, and past it at its share's max
    (``most_bytes``); asleep (0 bytes), the size it wakes to, which the scheduler kept from
    before sleep; the largest: ``max_cache_bytes``."""
    s, held = scheduler, scheduler.max_fit_bytes
    if s.growable:
        return s.reach_bytes, s.most_bytes, s.reach_note
    return (held if s.manager.cache_bytes == 0 else None), \
        max(held, s.manager.max_cache_bytes), None


def adapter_limit_tokens(scheduler, prompt_tokens: int, adapter: AdapterRef) -> int:
    """The most prompt + max_tokens a request of a ``prompt_tokens`` prompt on ``adapter`` may
    ask for without ``check_adapter_fits`` refusing it as too large (past it:
    RequestTooLargeError; up to it, at worst CacheShrunkError): the server's limit."""
    return _fit_beside(prompt_tokens, adapter, scheduler.manager,
                       *adapter_pool_bytes(scheduler))[1]


def _fit_beside(prompt_tokens: int, adapter: AdapterRef, manager, cache_bytes, most_bytes,
                reach_note) -> tuple:
    """(The longest sequence beside ``adapter`` at ``cache_bytes``; the longest at which it is
    not too large: ``most_bytes``' on a pool resized back up, ``cache_bytes``' on a
    MemoryBudget's reach (``reach_note``); the longest at ``most_bytes``)."""
    fit = adapter_fit_tokens(prompt_tokens, adapter, manager, cache_bytes)
    grown = most_bytes is not None and most_bytes != cache_bytes
    ever = max(fit, adapter_fit_tokens(prompt_tokens, adapter, manager, most_bytes)) \
        if grown else fit
    return fit, (fit if reach_note is not None else ever), ever


def check_adapter_fits(request, manager, cache_bytes=None, most_bytes=None,
                       reach_note=None) -> None:
    """RequestTooLargeError naming ``request``'s adapter when it, or it and the request's
    tokens, could never be held at once by ``manager``: in a pool of ``cache_bytes`` (None: as
    it is) and of ``most_bytes`` (the largest it may be resized to; None: ``cache_bytes``);
    CacheShrunkError when they fit only at ``most_bytes`` (``adapter_pool_bytes``), except on a
    MemoryBudget (``reach_note``: ``cache_bytes`` is its reach, ``most_bytes`` its share's
    max), where that is RequestTooLargeError naming the reach; ConfigError from a policy that
    holds no adapters."""
    ref, final = request.adapter, request.max_total_len
    pages, most = manager.adapter_pages(ref.num_bytes), manager.max_adapter_pages()
    if pages > most:
        raise RequestTooLargeError(
            f"request {request.request_id}: adapter {ref} can never fit: it needs {pages} "
            f"pool units, adapters can hold {most} at most (policy {manager.name!r})", None,
            "adapter")
    fit, _, most = _fit_beside(request.prompt_len, ref, manager, cache_bytes, most_bytes,
                               reach_note)
    if final <= fit:
        return
    asks = f"request {request.request_id}: {final} tokens beside adapter {ref}"
    field = "adapter" if fit == 0 else length_field(request.prompt_len, fit)
    if final <= most and reach_note is not None:
        raise RequestTooLargeError(f"{asks} do not fit the {fit} tokens of one sequence its "
                                   f"cache holds beside it {reach_note(most)}", None, field)
    if final <= most:       # (as check_length's rule: fits once resized back up)
        now = manager.cache_bytes if cache_bytes is None else cache_bytes
        raise CacheShrunkError(
            f"{asks} do not fit the cache at its current size ({now} bytes"
            f"{'' if manager.cache_bytes else ', the size it wakes to'}, {fit} tokens of one "
            f"sequence beside it); resized back up it holds {most}", None, field)
    grown = most_bytes is not None and most_bytes != cache_bytes
    at = f" at its max ({most_bytes} bytes)" if reach_note is not None else \
        f" resized up to {most_bytes} bytes" if grown else \
        "" if cache_bytes is None else f" in the {cache_bytes} bytes it has held at most"
    raise RequestTooLargeError(
        f"{asks} can never fit; the cache holds {most} tokens of one sequence beside it{at}",
        None, "adapter" if most == 0 else length_field(request.prompt_len, most))


def adapter_fit_tokens(prompt_tokens: int, adapter: AdapterRef, manager,
                       cache_bytes=None) -> int:
    """The longest sequence of a ``prompt_tokens`` prompt ``manager``'s pool holds beside
    ``adapter``, in a pool of ``cache_bytes`` (None: as it is); 0 when the adapter can never
    load. Behind a window a sequence holds less than its whole length: the units left beside
    the adapter are counted as ``Scheduler.fit_tokens`` counts the pool
    (``beam_fit.sequence_need``)."""
    fit = manager.max_sequence_tokens_with_adapter(adapter, cache_bytes)
    if fit > 0 and manager.window_tokens and manager.fork_unit_tokens:
        units = manager.kv_units_beside_adapter(adapter, cache_bytes)
        fit = max(fit, longest_sequence(prompt_tokens, units, manager.fork_unit_tokens,
                                        unit_costs(manager)[2], manager.max_seq_len))
    return fit
