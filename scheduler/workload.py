"""Workloads: request lengths and arrival times, generated from a seed or read from a trace.

A workload is a list of ``TraceEntry`` (prompt tokens, output tokens, arrival second). Lengths
are log-normal, parameterised the way papers quote them: prompts by median and 95th percentile,
outputs by mean and 95th percentile. Arrivals are all at time 0 (an offline batch) or Poisson at
a given rate (requests per second). A seed names one workload on every machine:

- ``rng="numpy"`` (the default, the standard workload's recipe in docs/simulation.md):
  ``numpy.random.default_rng(seed)``; all prompt lengths in one ``lognormal`` call, then all
  output lengths, then (Poisson) all inter-arrival gaps; lengths rounded to the nearest integer,
  at least 1; a request longer than ``max_total_len`` is scaled down to it, prompt and output in
  proportion (``scale_to_length``).
- ``rng="python"`` (the draw before issue 13): ``random.Random(seed)``, prompt then output per
  request, the prompt cut to leave one output token and the output cut to what remains.

LoRA workloads (S-LoRA's synthetic setting, issue 31: ``lora_workload``, ``assign_adapters``):
``LoraSpec.num_adapters`` adapters named ``lora-0000`` ..., adapter i the (i+1)-th most popular,
each of a rank drawn uniformly from ``LoraSpec.ranks`` (8, 16, 32, 64); every request names one,
drawn with probability proportional to (i + 1) ** -zipf_alpha (a power law; alpha 1 by default).
Lengths and arrivals are the generated workload's own, unchanged; the adapters come from a
second seeded stream, ``numpy.random.default_rng((seed, 31))``: first the N ranks, then one
adapter per request. An adapter's bytes (``lora_adapter_bytes``): LoRA A and B on the q, k, v and
o projections of every layer, fp16.

``TraceEntry`` and the project's JSONL trace format (``write_trace``, ``parse_trace_object``)
live in ``scheduler/trace_entry.py`` and are re-exported here; ``scheduler/traces.py`` reads
the bundled real traces (Azure, Mooncake) by name and every supported file format by path.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, List, Sequence, Tuple

from .errors import ConfigError
from .field_checks import check_int, check_number, check_seed
from .presets import ModelSpec
from .trace_entry import (MAX_ARRIVAL_S, MAX_TRACE_TOKENS, MOONCAKE_BLOCK_TOKENS,  # noqa: F401
                          TraceEntry, check_arrivals, parse_entry, parse_trace_object,
                          shown_int, synthetic_adapter, write_trace)
from .sim_memory import check_adapters_fit, check_workload_fits

if TYPE_CHECKING:
    from .adapters import AdapterRef

WORKLOAD_RNGS = ("numpy", "python")
Z95 = 1.6448536269514722  # standard normal 95th percentile


@dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload; defaults are the project's standard workload (docs/simulation.md)."""
    num_requests: int = 2000
    prompt_median: float = 584.0   # tokens; log-normal median of prompt length
    prompt_p95: float = 2155.0     # tokens; 95th percentile of prompt length
    output_mean: float = 374.0     # tokens; log-normal mean of output length
    output_p95: float = 1118.0     # tokens; 95th percentile of output length
    max_total_len: int = 4096      # prompt + output clipped to this (the model's max length)
    arrival_rate: float = 0.0      # requests per second (Poisson); 0 = all arrive at time 0
    seed: int = 0
    rng: str = "numpy"             # "numpy" (the documented recipe) or "python" (the old draw)

    def __post_init__(self) -> None:
        check_int("WorkloadSpec.num_requests", self.num_requests, 1)
        check_int("WorkloadSpec.max_total_len", self.max_total_len, 2)
        check_number("WorkloadSpec.arrival_rate", self.arrival_rate, unit="requests/s")
        check_seed("WorkloadSpec", self.seed)
        if self.arrival_rate and self.num_requests > MAX_ARRIVAL_S * self.arrival_rate:
            raise ConfigError(f"WorkloadSpec.arrival_rate {self.arrival_rate:g} requests/s puts "
                              f"{self.num_requests:,} requests past {MAX_ARRIVAL_S:.0e} s (317 "
                              f"years): give at least {self.num_requests / MAX_ARRIVAL_S:.3g}")
        if self.rng not in WORKLOAD_RNGS:
            raise ConfigError(f"WorkloadSpec.rng must be one of {', '.join(WORKLOAD_RNGS)}, "
                              f"got {self.rng!r}")
        for name in ("prompt_median", "prompt_p95", "output_mean", "output_p95"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float))
                                               and 1 <= value <= MAX_TRACE_TOKENS):
                raise ConfigError(f"WorkloadSpec.{name} must be a number of tokens in [1, "
                                  f"{MAX_TRACE_TOKENS:,}], got {value!r}")
        lognormal_from_median_p95(self.prompt_median, self.prompt_p95, "prompt")
        lognormal_from_mean_p95(self.output_mean, self.output_p95, "output")


def lognormal_from_median_p95(median: float, p95: float, what: str = "length") -> Tuple[float, float]:
    """(mu, sigma) of the log-normal with this median and 95th percentile (p95 > median > 0)."""
    if not (median > 0 and p95 > median):
        raise ConfigError(f"{what} needs 0 < median < p95, got median={median!r}, p95={p95!r}")
    mu = math.log(median)
    return mu, (math.log(p95) - mu) / Z95


def lognormal_from_mean_p95(mean: float, p95: float, what: str = "length") -> Tuple[float, float]:
    """(mu, sigma) of the log-normal with this mean and 95th percentile.

    mu + sigma^2/2 = ln(mean) and mu + z*sigma = ln(p95) give sigma^2 - 2z*sigma + 2(ln p95 - ln mean)
    = 0. Of the two roots we take the smaller, z - sqrt(z^2 - 2d): the larger one is > z and puts
    the median orders of magnitude below the mean. A real root needs p95 / mean <= e^(z^2/2) ~ 3.87.
    """
    if not (mean > 0 and p95 > mean):
        raise ConfigError(f"{what} needs 0 < mean < p95, got mean={mean!r}, p95={p95!r}")
    d = math.log(p95) - math.log(mean)
    disc = Z95 * Z95 - 2.0 * d
    if disc < 0:
        raise ConfigError(f"{what}: no log-normal has mean={mean!r} and p95={p95!r} "
                          f"(p95/mean must be <= {math.exp(Z95 * Z95 / 2):.2f})")
    sigma = Z95 - math.sqrt(disc)
    return math.log(mean) - sigma * sigma / 2.0, sigma


def generate(spec: WorkloadSpec) -> List[TraceEntry]:
    """``spec.num_requests`` entries, arrivals sorted; prompt + output never exceed
    ``spec.max_total_len`` and both are >= 1. ``spec.rng`` picks the draw (module docstring)."""
    p_mu, p_sigma = lognormal_from_median_p95(spec.prompt_median, spec.prompt_p95, "prompt")
    o_mu, o_sigma = lognormal_from_mean_p95(spec.output_mean, spec.output_p95, "output")
    check_workload_fits(spec.num_requests, "lower num_requests")   # before drawing a request
    if spec.rng == "python":
        return _generate_python(spec, (p_mu, p_sigma), (o_mu, o_sigma))
    import numpy as np
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    # clipped to MAX_TRACE_TOKENS before the int64 cast (a wide sigma draws past 2^63), then
    # scaled to max_total_len as any long request is
    prompts = np.clip(np.rint(rng.lognormal(p_mu, p_sigma, n)), 1, MAX_TRACE_TOKENS).astype(np.int64)
    outputs = np.clip(np.rint(rng.lognormal(o_mu, o_sigma, n)), 1, MAX_TRACE_TOKENS).astype(np.int64)
    arrivals = (np.cumsum(rng.exponential(1.0 / spec.arrival_rate, n)) if spec.arrival_rate > 0
                else np.zeros(n))
    entries = []
    for p, o, t in zip(prompts.tolist(), outputs.tolist(), arrivals.tolist()):
        p, o = scale_to_length(p, o, spec.max_total_len)
        entries.append(TraceEntry(p, o, t))
    return entries


def _generate_python(spec: WorkloadSpec, prompt_params, output_params) -> List[TraceEntry]:
    """The draw before issue 13 (``rng="python"``): per request prompt, output, gap; clipped
    (to ``MAX_TRACE_TOKENS`` too, as the numpy draw is: past it a TraceEntry refused it)."""
    rng = random.Random(spec.seed)
    entries, t = [], 0.0
    longest = min(MAX_TRACE_TOKENS, spec.max_total_len - 1)
    for _ in range(spec.num_requests):
        prompt = round(min(max(1.0, rng.lognormvariate(*prompt_params)), longest))
        output = round(min(max(1.0, rng.lognormvariate(*output_params)),
                           MAX_TRACE_TOKENS, spec.max_total_len - prompt))
        if spec.arrival_rate > 0:
            t += rng.expovariate(spec.arrival_rate)
        entries.append(TraceEntry(prompt, output, t))
    return entries


def scale_to_length(prompt_len: int, output_len: int, max_total_len: int) -> Tuple[int, int]:
    """(prompt, output) unchanged when their sum fits ``max_total_len`` (>= 2), else both
    scaled by ``max_total_len / sum`` and rounded, each >= 1, the sum <= ``max_total_len``."""
    total = prompt_len + output_len
    if total <= max_total_len:
        return prompt_len, output_len
    factor = max_total_len / total
    prompt = min(max(1, round(prompt_len * factor)), max_total_len - 1)
    return prompt, max(1, min(round(output_len * factor), max_total_len - prompt))


# --- LoRA adapters (issue 31) -------------------------------------------------------------------

LORA_RANKS = (8, 16, 32, 64)      # S-LoRA's synthetic experiments draw ranks from these
LORA_DTYPE_BYTES = 2              # adapter weights in fp16 / bf16
LORA_STREAM = 31                  # the adapters' numpy stream: default_rng((seed, 31))

# (hidden size, query heads) of each preset: a LoRA pair's shapes need them and ModelSpec holds
# only the KV geometry (from each model's config.json)
LORA_SHAPES = {
    "llama-3-8b": (4096, 32),
    "opt-13b": (5120, 40),
    "mistral-7b-v0.1": (4096, 32),
    "mistral-7b-v0.3": (4096, 32),
    "gemma-3-27b": (5376, 32),
    "phi-2": (2560, 32),
}


@dataclass(frozen=True)
class LoraSpec:
    """A population of LoRA adapters and how requests pick them (module docstring)."""
    num_adapters: int
    zipf_alpha: float = 1.0                 # popularity of adapter i: (i + 1) ** -alpha
    ranks: Tuple[int, ...] = LORA_RANKS     # each adapter's rank drawn uniformly from these
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_adapters, bool) or not isinstance(self.num_adapters, int) \
                or self.num_adapters < 1:
            raise ConfigError(f"LoraSpec.num_adapters must be an int >= 1, got "
                              f"{self.num_adapters!r}")
        if isinstance(self.zipf_alpha, bool) or not (isinstance(self.zipf_alpha, (int, float))
                                                     and 0 <= self.zipf_alpha < math.inf):
            raise ConfigError(f"LoraSpec.zipf_alpha must be a finite number >= 0, got "
                              f"{self.zipf_alpha!r}")
        if not isinstance(self.ranks, (list, tuple)) or not self.ranks or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in self.ranks):
            raise ConfigError(f"LoraSpec.ranks must be a list or tuple of ints >= 1, got "
                              f"{self.ranks!r}")     # ranks=8 was a TypeError from tuple(8)
        object.__setattr__(self, "ranks", tuple(self.ranks))
        check_seed("LoraSpec", self.seed)


def lora_adapter_bytes(model: ModelSpec, rank: int) -> int:
    """Bytes of a rank-``rank`` LoRA adapter of ``model`` on the q, k, v and o projections of
    every layer, fp16: A (in x r) and B (r x out) per projection, so per layer
    r (hidden + q_out) + 2 r (hidden + kv_out) + r (q_out + hidden) elements (q_out = query
    heads x head_dim, kv_out = KV heads x head_dim). Llama-3-8B: 1,703,936 bytes per unit of
    rank (rank 64: 109 MB); a Llama-7B (MHA) rank-64 adapter: 134,217,728 bytes (128 MiB)."""
    shape = LORA_SHAPES.get(model.name)
    if shape is None:
        raise ConfigError(f"no LoRA shapes for model {model.name!r} (hidden size and query heads "
                          f"are needed); known: {', '.join(sorted(LORA_SHAPES))}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"LoRA rank must be an int >= 1, got {rank!r}")
    hidden, heads = shape
    q_out, kv_out = heads * model.head_dim, model.num_kv_heads * model.head_dim
    per_layer = rank * ((hidden + q_out) + 2 * (hidden + kv_out) + (q_out + hidden))
    return per_layer * model.num_layers * LORA_DTYPE_BYTES


def zipf_weights(n: int, alpha: float) -> List[float]:
    """Probabilities of adapters 0..n-1: (i + 1) ** -alpha, normalised (alpha 0: uniform)."""
    raw = [(i + 1) ** -alpha for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def _lora_rng(lora: LoraSpec):
    import numpy as np
    return np.random.default_rng((lora.seed, LORA_STREAM))


def make_adapters(lora: LoraSpec, model: ModelSpec) -> List["AdapterRef"]:
    """The ``lora.num_adapters`` adapters, most popular first: ``lora-0000`` ... with ranks
    drawn uniformly from ``lora.ranks`` (the stream's first draws)."""
    return _draw_adapters(_lora_rng(lora), lora, model)


def _draw_adapters(rng, lora: LoraSpec, model: ModelSpec) -> List["AdapterRef"]:
    ranks = rng.choice(len(lora.ranks), size=lora.num_adapters).tolist()
    width = max(4, len(str(lora.num_adapters - 1)))
    return [synthetic_adapter(f"lora-{i:0{width}d}", lora_adapter_bytes(model, lora.ranks[r]))
            for i, r in enumerate(ranks)]


def adapter_rank(ref: "AdapterRef", model: ModelSpec) -> int:
    """The rank a synthetic adapter of ``model`` was sized for (its bytes / bytes per rank)."""
    return ref.num_bytes // lora_adapter_bytes(model, 1)


def assign_adapters(entries: Sequence[TraceEntry], lora: LoraSpec,
                    model: ModelSpec) -> List[TraceEntry]:
    """``entries`` with an adapter each, drawn Zipf(``lora.zipf_alpha``) from
    ``make_adapters(lora, model)`` (the same stream, after the ranks), in the entries' order."""
    import numpy as np
    check_adapters_fit(lora.num_adapters, "lower num_adapters")   # before any is drawn
    rng = _lora_rng(lora)
    adapters = _draw_adapters(rng, lora, model)
    picks = rng.choice(lora.num_adapters, size=len(entries),
                       p=np.asarray(zipf_weights(lora.num_adapters, lora.zipf_alpha)))
    return [replace(e, adapter=adapters[i]) for e, i in zip(entries, picks.tolist())]


def lora_workload(spec: WorkloadSpec, lora: LoraSpec, model: ModelSpec) -> List[TraceEntry]:
    """``generate(spec)`` (the same lengths and arrivals) with a Zipf-popular adapter per
    request (``assign_adapters``); ``lora.seed`` is independent of ``spec.seed``."""
    return assign_adapters(generate(spec), lora, model)
