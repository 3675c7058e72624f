"""What the engine hands back: streamed token events, finished request outputs, run statistics."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from vmemkv.scheduler.metrics import latency_summary
from vmemkv.scheduler.report import RequestTiming

from .logprobs import TokenLogprobs


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of sample ``index`` of request ``request_id``, as soon as it exists."""
    request_id: int
    index: int                         # which of the request's n samples
    token_id: int
    finished: bool                     # this was the sample's last token
    finish_reason: Optional[str] = None  # "stop" (a stop token or string) or "length"
    text: str = ""                     # with a tokenizer: the text this token adds (complete
                                       # characters only; held back near a stop string)
    logprobs: Optional[TokenLogprobs] = None   # when SamplingParams.logprobs is set
    stop_reason: Union[int, str, None] = None  # finished "stop": what stopped it (CompletionOutput)

# The phases EngineStats splits step time into (each has a ``<phase>_s`` field).
STEP_PHASES = ("schedule", "plan", "metadata", "model", "attention", "sample")

# How a request ends (RequestOutput.status); "unfinished" until then.
ENDED_STATUSES = ("finished", "aborted", "failed")


@dataclass
class CompletionOutput:
    """One sample's generated tokens (the stop token, when one ended it, is included; so is
    the token that completed a stop string). ``finish_reason``: "stop", "length", or "abort" /
    "error" when its request was aborted / failed before the sample finished. ``text`` (with a
    tokenizer): the tokens' text, cut at the first stop string (``runtime/engine/detokenize``);
    while the sample runs, what its TokenEvents showed so far ("" before its first token).
    ``logprobs``: one entry per token when SamplingParams.logprobs is set, else None.
    ``stop_reason`` (vLLM's): of a sample that ended "stop", the stop string that ended it, or
    the token id of ``stop_token_ids`` that did; None for an EOS token and any other ending."""
    index: int
    token_ids: List[int]
    finish_reason: Optional[str] = None
    text: Optional[str] = None
    token_times_s: List[float] = field(default_factory=list)  # when each token was sampled:
                                                              # engine-clock wall seconds
    logprobs: Optional[List[TokenLogprobs]] = None
    beam_score: Optional[float] = None   # beam search: cumulative_logprob / tokens **
                                         # length_penalty, what the beams are ranked by
    stop_reason: Union[int, str, None] = None

    @property
    def cumulative_logprob(self) -> Optional[float]:
        """The sum of the tokens' logprobs (natural log), when they were asked for."""
        return None if self.logprobs is None else sum(e.logprob for e in self.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestError:
    """Why a request failed: the exception's type name and message (the engine went on);
    ``field``: the request field at fault when its own parameters were (a RequestRejectedError's,
    e.g. ``repetition_penalty``), else None."""
    type: str
    message: str
    field: Optional[str] = None


@dataclass
class RequestOutput:
    """A request's prompt and its ``n`` samples, in sample order. ``status`` is "unfinished"
    until the request ends "finished", "aborted" (``Engine.abort``) or "failed" (its memory
    plans kept failing: ``error`` says why; its memory was released, other requests went on)."""
    request_id: int
    prompt_token_ids: Tuple[int, ...]
    outputs: List[CompletionOutput]
    prompt: Optional[str] = None
    status: str = "unfinished"
    error: Optional[RequestError] = None
    arrival_s: float = 0.0             # when it was submitted, the engine clock (seconds)
    prompt_logprobs: Optional[List[Optional[TokenLogprobs]]] = None   # with
    # SamplingParams.prompt_logprobs, once the prompt is computed: one entry per prompt token,
    # None for the first (nothing predicts it); see runtime/engine/logprobs.py

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


def request_timings(outputs: Sequence[RequestOutput]) -> List[RequestTiming]:
    """One ``RequestTiming`` per request of ``outputs`` (for ``report.serving_report``, which
    counts requests and their prompts once): its arrival, the token times of its first sample
    with a token (the simulator times a request by its first sequence too), the prompt length,
    its other samples' tokens for the throughputs, and its last token of any sample (E2EL and
    the duration end there: an n > 1 request whose first sample stopped early ended with it).
    Requests without a token are skipped (one per sample, an n=3 request counted 3 requests and
    its prompt 3 times)."""
    timings = []
    for out in outputs:
        timed = [c.token_times_s for c in out.outputs if c.token_times_s]
        if timed:
            timings.append(RequestTiming(out.arrival_s, tuple(timed[0]), len(out.prompt_token_ids),
                                         other_output_tokens=sum(map(len, timed[1:])),
                                         last_token_s=max(times[-1] for times in timed)))
    return timings


@dataclass(frozen=True)
class EngineStats:
    """Figures of one ``generate`` (or any window of steps). Seconds, tokens, bytes as named."""
    cache: str
    attention: str
    requests: int                 # requests that finished (not aborted or failed), each once
    prompt_tokens: int            # the prompt tokens of those requests, each prompt once
    output_tokens: int            # tokens sampled, every sample and beam of every request
    steps: int
    wall_s: float
    step_s: float                 # time inside step(): ops + model + sampling + bookkeeping
    mapping_s: float              # time applying vmem page ops (inline or on the mapper thread)
    mapping_stall_s: float            # of step time, blocked on mapping (inline mapping, or waiting
                                  # for the background mapper)
    num_preemptions: int
    num_swap_preemptions: int
    recomputed_tokens: int        # computed tokens thrown away by recompute: a preempted
                                  # sequence's, a forked sample's that found no room
    kv_usage_mean: float          # kv_cache_usage_perc as a fraction (1 - free / total), mean over steps
    kv_usage_peak: float
    cache_bytes: int
    computed_tokens: int = 0          # tokens steps computed (prefill + decode); a prefix hit's
                                      # tokens are not among them
    prefix_cache_queries: int = 0     # prompt tokens offered to the prefix cache
    prefix_cache_hits: int = 0        # of those, served from cached K/V
    lora_adapter_loads: int = 0       # LoRA adapters loaded into the pool (LoadAdapter)
    lora_adapter_evictions: int = 0   # idle adapters evicted from the pool for KV
    lora_adapter_pages: int = 0       # pool pages / blocks adapters held at the end
    # step time split (host seconds, each <= step_s, together at most step_s; the rest is
    # bookkeeping: commits, scheduler update, events):
    schedule_s: float = 0.0       # scheduler.schedule(): the plan
    plan_s: float = 0.0           # executing its memory ops and table edits (incl. mapping)
    metadata_s: float = 0.0       # begin_step and the step's input tensors
    model_s: float = 0.0          # the model's forward minus attention (its math, HF's per-layer
                                  # Python, the K/V writes)
    attention_s: float = 0.0      # inside the attention backend
    sample_s: float = 0.0         # sampling the step's tokens
    ttft_s: List[float] = field(default_factory=list, repr=False)
    itl_s: List[float] = field(default_factory=list, repr=False)
    serving: Dict[str, float] = field(default_factory=dict, repr=False)  # serving_report (ms)
                                  # of the outputs that finished (as ``requests`` counts them)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def mapping_share(self) -> float:
        """Share of step time spent blocked on page mapping."""
        return self.mapping_stall_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of step time outside the model's forward and the attention backend."""
        if self.step_s <= 0:
            return 0.0
        return max(0.0, 1.0 - (self.model_s + self.attention_s) / self.step_s)

    def step_split(self) -> dict:
        """Each phase's share of step time, plus "other" (bookkeeping), summing to 1."""
        phases = {p: getattr(self, f"{p}_s") for p in STEP_PHASES}
        if self.step_s <= 0:
            return {**dict.fromkeys(phases, 0.0), "other": 0.0}
        shares = {p: t / self.step_s for p, t in phases.items()}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        return shares

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "itl_s", "serving")}
        out["tokens_per_s"] = self.tokens_per_s
        out["mapping_share"] = self.mapping_share
        out["overhead_share"] = self.overhead_share
        out.update(latency_summary("ttft", self.ttft_s))
        out.update(latency_summary("itl", self.itl_s))
        out.update(self.serving)
        return out

    def summary(self) -> str:
        d = self.as_dict()
        ms = lambda s, digits: "n/a" if s != s else f"{s * 1e3:.{digits}f} ms"  # noqa: E731 (NaN: none)
        return (f"{self.requests} requests, {self.output_tokens} output tokens in {self.wall_s:.2f} s "
                f"= {self.tokens_per_s:.1f} tok/s ({self.steps} steps) | TTFT p50 "
                f"{ms(d['ttft_p50_s'], 1)}, ITL p50 {ms(d['itl_p50_s'], 2)} | "
                f"KV {self.cache} {self.cache_bytes / 2**20:.1f} MiB, usage mean "
                f"{self.kv_usage_mean:.0%} peak {self.kv_usage_peak:.0%} | preemptions "
                f"{self.num_preemptions} ({self.num_swap_preemptions} swap) | mapping "
                f"{self.mapping_share:.1%} of step time | attention {self.attention} | step: "
                + ", ".join(f"{p} {s:.0%}" for p, s in self.step_split().items()))
