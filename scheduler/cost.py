"""A roofline cost model of one scheduler step, in seconds.

    memory time  = (weight bytes + KV bytes read * kernel slowdown) / bandwidth
    compute time = 2 * params * new tokens / (MFU * peak FLOP/s)     (only when prefill_mfu is set)
    step time    = max(memory time, compute time) + mapped pages * map latency

KV bytes read = (tokens in context, summed over every scheduled sequence) * bytes per token: a
decode reads its whole cache, a prefill chunk its cached prefix plus its new tokens. With
``prefill_mfu`` unset (the default) prefill tokens cost only this bandwidth term, which is the
decode roofline the project's standard experiment uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .field_checks import check_fraction_or_none, check_int, check_number
from .managers.base import MapExtent
from .presets import DeviceSpec, ModelSpec


@dataclass(frozen=True)
class CostModel:
    """Seconds per step for a model on a device; validated on construction."""
    model: ModelSpec
    device: DeviceSpec
    prefill_mfu: Optional[float] = None   # fraction of peak FLOP/s reached by prefill; None = off
    map_latency_s: float = 0.0            # seconds per physical page mapped (vmem MapExtent ops)
    pages_per_map_op: int = 1             # physical pages behind one page group's mapping
    kv_slowdown: float = 1.0              # multiplier on KV read time (paged-kernel overhead)

    def __post_init__(self) -> None:
        check_fraction_or_none("prefill_mfu", self.prefill_mfu)
        check_number("map_latency_s", self.map_latency_s, unit="seconds")   # inf: NaN durations
        check_int("pages_per_map_op", self.pages_per_map_op, 1)
        check_number("kv_slowdown", self.kv_slowdown, 1.0)

    def step_seconds(self, context_tokens: int, new_tokens: int, mapped_pages: int = 0,
                     num_seqs: int = 0, prefill_pairs: int = 0, cold_step: bool = False,
                     after_idle: bool = False) -> float:
        """Time of one step that reads ``context_tokens`` of KV (summed over sequences), computes
        ``new_tokens`` tokens and maps ``mapped_pages`` physical pages first. ``num_seqs`` (the
        step's sequences), ``prefill_pairs`` (``prefill_pairs()``), ``cold_step``
        (``AfterPrefill``) and ``after_idle`` (the step follows a time with nothing to run) do
        not enter the roofline; a measured profile charges them."""
        bw = self.device.memory_bandwidth_bytes_per_s
        t = (self.model.weight_bytes + context_tokens * self.model.bytes_per_token * self.kv_slowdown) / bw
        if self.prefill_mfu is not None:
            t = max(t, 2.0 * self.model.params * new_tokens / (self.prefill_mfu * self.device.peak_flops_per_s))
        return t + mapped_pages * self.map_latency_s


def prefill_pairs(seqs) -> int:
    """Query-key pairs of causal attention beyond one per context token, summed over a plan's
    ``ScheduledSeq``s: a sequence computing n new tokens after c cached ones attends
    n*c + n*(n+1)/2 pairs and reads c + n context tokens, so (n - 1) * (c + n / 2) more. Zero for
    a decode (n = 1); a whole prompt of L tokens adds L * (L - 1) / 2, the quadratic part of
    prefill that a per-token cost cannot follow."""
    return sum((s.num_new_tokens - 1) * (2 * s.num_computed_tokens + s.num_new_tokens) // 2
               for s in seqs)


COLD_STEPS = 3     # decode-only steps after a prefill that run cold (AfterPrefill)


class AfterPrefill:
    """Which steps are cold: the first ``COLD_STEPS`` decode-only steps after a step that
    computed prompt tokens (one with ``prefill_pairs`` > 0). Measured on a CPU, those run
    1.1-1.7x a warm decode (the prefill's activations evicted the weights and cache from the
    CPU caches), the 4th onwards at the warm cost. Call ``cold`` once per step, in order."""

    def __init__(self) -> None:
        self.left = 0                      # cold decode steps still to come

    def cold(self, prefill_pairs: int, num_seqs: int) -> bool:
        """Whether this step (its prefill pairs and sequences) is a cold decode step."""
        if prefill_pairs:
            self.left = COLD_STEPS
            return False
        if not num_seqs or not self.left:
            return False
        self.left -= 1
        return True


def count_map_ops(ops: list) -> int:
    """Page groups newly mapped at a page index in a step's op list (each maps
    ``pages_per_map_op`` physical pages): MapExtent ops from member page 0, the kinds of one
    group mapped at one place (consecutive ops at one (slot, page_index)) counted once."""
    count, last = 0, None
    for op in ops:
        if type(op) is MapExtent and op.first_page == 0:
            spot = (op.slot, op.page_index)
            count += spot != last
            last = spot
        else:
            last = None
    return count
