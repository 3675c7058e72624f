"""Requests (what a user submits) and sequences (what the scheduler runs and the manager holds).

A request with ``n`` samples becomes ``n`` sequences once its prompt is computed: the first
sequence prefills the prompt, the other n - 1 are forked from it and share its memory.

Token accounting of one sequence (every count in tokens):

    all tokens   = prompt + output                     len == seq.length
    [0, num_computed)          K/V are in the cache (written by an earlier step)
    [num_computed, length)     still to compute: the prompt (prefill), or the one last sampled
                               token (decode), or everything after a recompute preemption
    a step computes some of the pending tokens; when it computes the last one it samples a new
    token, which is appended to the output (and is itself pending until the next step).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .adapters import AdapterRef, check_adapter
from .errors import ConfigError
from .managers.prefix import SALT_MARK, prefix_scope


class SeqState(enum.Enum):
    WAITING = "waiting"     # holds no memory; will (re)compute all of its tokens when admitted
    RUNNING = "running"     # holds memory for at least num_computed tokens
    SWAPPED = "swapped"     # its cache is in host swap space; holds no device memory
    FINISHED = "finished"   # max tokens or a stop token reached; memory released
    ABORTED = "aborted"     # ended by Scheduler.abort_request (Engine.abort); memory released
    FAILED = "failed"       # ended because its memory plans kept failing; memory released

    @property
    def is_ended(self) -> bool:
        """Finished, aborted or failed: the sequence holds nothing and never runs again."""
        return self in _ENDED


_ENDED = frozenset((SeqState.FINISHED, SeqState.ABORTED, SeqState.FAILED))


@dataclass(frozen=True)
class Request:
    """What a user submits. Lengths are in tokens, times in seconds."""
    request_id: int
    prompt_len: int                                  # tokens in the prompt
    max_tokens: int                                  # output tokens to generate at most
    prompt_token_ids: Optional[Tuple[int, ...]] = None  # needed for prefix sharing and the engine
    stop_token_ids: Tuple[int, ...] = ()             # finish early when one is sampled
    arrival_s: float = 0.0                           # when it becomes schedulable
    n: int = 1                                       # independent samples (parallel sampling)
    namespace: Optional[str] = None                  # prefixes only shared within a namespace
    cache_salt: Optional[str] = None                 # vLLM's name: prefixes only shared by
                                                     # requests with the same salt (isolation)
    beam_width: int = 0                              # > 0: a beam group (its caller picks the
                                                     # beams each step; scheduled as one)
    adapter: Optional[AdapterRef] = None             # the LoRA adapter it runs with (None: the
                                                     # base model); pinned while it runs
    runs_to_max_tokens: bool = False                 # nothing can end it early (a beam search
                                                     # without stop ids): checked at full length
    prefix_lookup: bool = True                       # False: reads no prefix cache, counts no
                                                     # query (prompt logprobs: every row
                                                     # computed); still publishes under its scope

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_len, int) or self.prompt_len < 1:
            raise ConfigError(f"Request.prompt_len must be an int >= 1, got {self.prompt_len!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"Request.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"Request.n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.beam_width, int) or self.beam_width < 0:
            raise ConfigError(f"Request.beam_width must be an int >= 0, got {self.beam_width!r}")
        if self.beam_width and self.n != 1:
            raise ConfigError(f"Request.n must be 1 for a beam group (beam_width "
                              f"{self.beam_width}), got {self.n!r}")
        if not self.arrival_s >= 0:
            raise ConfigError(f"Request.arrival_s must be >= 0, got {self.arrival_s!r}")
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
            if len(self.prompt_token_ids) != self.prompt_len:
                raise ConfigError(f"Request.prompt_token_ids has {len(self.prompt_token_ids)} ids "
                                  f"but prompt_len is {self.prompt_len}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("namespace", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"Request.{name} must be a str or None, got {value!r}")
        check_adapter(self.adapter, "Request.adapter")
        if not isinstance(self.prefix_lookup, bool):
            raise ConfigError(f"Request.prefix_lookup must be a bool, got {self.prefix_lookup!r}")
        if self.namespace is not None and self.namespace.startswith(SALT_MARK):
            raise ConfigError(f"Request.namespace may not start with {SALT_MARK!r} (reserved "
                              f"for cache salts), got {self.namespace!r}")

    @property
    def prefix_scope(self) -> Optional[str]:
        """What the managers key this request's prefixes by: its namespace, cache salt and
        adapter's content digest (all enter the SHA-256 chain's root, so different salts or
        adapters never share; a base-model request keeps the keys it always had)."""
        adapter = self.adapter
        return prefix_scope(self.namespace, self.cache_salt,
                            None if adapter is None else adapter.digest)

    @property
    def max_total_len(self) -> int:
        """Tokens a sequence of this request holds at most: prompt + max_tokens."""
        return self.prompt_len + self.max_tokens


class Sequence:
    """One sample of a request: the scheduler's unit of work and the manager's ``seq_id``."""

    __slots__ = ("seq_id", "request", "output", "length", "num_computed", "held", "state",
                 "admit_order", "pending_forks", "last_token_s", "arrival_s", "max_tokens",
                 "stop_ids", "beam_width", "adapter_id", "shared_from")

    def __init__(self, seq_id: int, request: Request, output: Optional[List[int]] = None):
        self.seq_id = seq_id
        self.request = request
        self.output: List[int] = list(output or ())
        self.length = request.prompt_len + len(self.output)   # tokens, prompt + output
        self.num_computed = 0      # tokens whose K/V are cached
        self.held = 0              # tokens the manager holds room for (>= num_computed)
        self.state = SeqState.WAITING
        self.admit_order = -1      # admission counter; the highest is preempted first
        self.pending_forks: Tuple[int, ...] = ()   # children to fork when the prompt is done
        self.last_token_s: Optional[float] = None   # when its last token was sampled
        self.arrival_s = request.arrival_s
        self.max_tokens = request.max_tokens         # copied from the request: the hot path
        self.stop_ids = request.stop_token_ids
        self.beam_width = request.beam_width         # > 0: a member of a beam group
        adapter = request.adapter                    # its digest, for the plan (None: base)
        self.adapter_id = None if adapter is None else adapter.digest
        # (leader, tokens): a recomputed beam whose first ``tokens`` are the leader's memory,
        # which it computes; this one starts after them once it has (beam_groups.py)
        self.shared_from: Optional[Tuple["Sequence", int]] = None

    def save(self) -> tuple:
        """The fields ``Scheduler.schedule()`` or ``update()`` may change, for ``restore`` (a
        rollback). ``output`` only grows: its length is kept."""
        return (self.state, self.held, self.num_computed, self.admit_order, len(self.output),
                self.length, self.last_token_s, self.pending_forks, self.shared_from)

    def restore(self, saved: tuple) -> None:
        (self.state, self.held, self.num_computed, self.admit_order, outputs,
         self.length, self.last_token_s, self.pending_forks, self.shared_from) = saved
        del self.output[outputs:]

    def token_ids(self) -> Optional[List[int]]:
        """All token ids (prompt + output) when the prompt's ids are known, else None."""
        if self.request.prompt_token_ids is None:
            return None
        return list(self.request.prompt_token_ids) + self.output

    def new_token_ids(self, start: int, stop: int) -> Optional[Tuple[int, ...]]:
        """Ids of tokens [start, stop) when known: output ids are always known, prompt ids only
        when the request carries them."""
        p = self.request.prompt_len
        prompt = self.request.prompt_token_ids
        if start >= p:
            return tuple(self.output[start - p:stop - p])
        if prompt is None:
            return None
        return tuple(prompt[start:min(stop, p)]) + tuple(self.output[:max(0, stop - p)])

    @property
    def in_prefill(self) -> bool:
        """More to compute than the one pending decode token (prompt, or a recompute)."""
        return self.length - self.num_computed > 1 or not self.output

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, {self.state.value}, "
                f"len={self.length}, computed={self.num_computed}, held={self.held})")

