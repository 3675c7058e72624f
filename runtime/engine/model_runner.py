"""ModelRunner: one scheduler step's packed batch through an HF causal LM on one of our caches.

    plan.seqs  s0: prefill 5 tokens | s1: decode 1 | s2: prefill chunk 3 (no sample)
    input_ids  [t t t t t | t | t t t]                      (1, T=9)
    positions  [0 1 2 3 4 | 17 | 8 9 10]                    each token's index in its sequence
    keep       [4, 5]                                       rows whose logits are sampled
               (+ every row of a sequence in ``prompt_rows``: prompt logprobs, only those;
               at most max_tokens_per_step rows of fp32 logits, checked beside the cache when
               the engine is built, and scored in slices: logprobs.step_logits_bytes)

Everything per step is built once (ids, positions, keep rows); the per-layer work is the HF
layer itself plus one cache write and one backend call (runtime.hf.attention).

Each forward holds the model's ``model_lock`` (one uncontended RLock per step): another engine
on the same model object, built on another thread, switches the model-wide attention
implementation for its self-check (and calibration) under that lock, so it waits for this
forward, and this one for its switch. Under the lock the forward first puts the model back on
our attention if something switched it since (one string compare when nothing did).

``phase_s`` adds up, in host seconds (``time.perf_counter``), where execute() spends its time:
"plan" (memory ops and table edits), "metadata" (begin_step and the step's input tensors),
"model" (the model's forward minus attention: its own math, HF's per-layer Python, the K/V
writes) and "attention" (inside the backend's forward, as it counts it).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Collection, Dict, List, Optional, Tuple

import torch

from vmemkv.runtime.interrupts import deferred_interrupts
from vmemkv.runtime.hf.attention import (STEP_KWARG, StepContext, model_lock,
                                         use_vmemkv_attention)

from .errors import EngineConfigError, LogitsShapeError


PHASES = ("plan", "metadata", "model", "attention")


class ModelRunner:
    """Executes plans: memory ops and table edits on the cache, then the model on the plan's
    new tokens. Reads nothing but the plan (no manager, no scheduler)."""

    def __init__(self, model: torch.nn.Module, cache, backend,
                 max_context_tokens: Optional[int] = None) -> None:
        use_vmemkv_attention(model)
        self.model = model.eval()
        self._lock = model_lock(model)      # held for each forward (see the module's doc)
        self._attn = model.config._attn_implementation   # what ours reads as on this model
        self.cache = cache
        self.backend = backend
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.get_text_config().vocab_size   # each logits row's width
        self._ctx = StepContext(cache, backend, max_context_tokens)   # the engine's limit
        self.ops_applied = False   # the last execute() got past its memory ops (engine rollback)
        self.phase_s: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        # prompt logprobs: the seq ids whose every new row's logits the engine wants (a
        # container it owns), and after each execute() {seq_id: (first position, rows' logits)}
        self.prompt_rows: Collection[int] = ()
        self.prompt_logits: Dict[int, Tuple[int, torch.Tensor]] = {}
        self.adapters = None   # the engine's EngineAdapters once it serves LoRA adapters

    def _add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_s[phase] += now - since
        return now

    def execute(self, plan) -> Tuple[Optional[torch.Tensor], List[int]]:
        """Run ``plan`` (plain data: it may have crossed a process boundary): its memory ops,
        its table edits, then the model. Returns logits ``[rows, vocab]`` of the sampling
        sequences (in plan order) and, for each, its index in ``plan.seqs``. (None, []) when
        nothing sampled."""
        self.ops_applied = False
        self.prompt_logits = {}
        start = time.perf_counter()
        try:
            with deferred_interrupts():    # a Ctrl-C between the two lands after both
                self.cache.execute(plan.ops)
                self.ops_applied = True    # from here a failure keeps the memory (lifecycle)
            self.cache.apply_tables(plan.tables)
        finally:
            start = self._add("plan", start)
        if self.adapters is not None:   # weights into the pages LoadAdapter ops mapped
            self.adapters.apply(plan.ops, self.cache)
        if not plan.seqs:
            return None, []
        return self._run_model(plan, start)

    def _run_model(self, plan, start: float) -> Tuple[Optional[torch.Tensor], List[int]]:
        input_ids, positions, keep_rows, sampling, prompt = self._inputs(plan)
        start = self._add("metadata", start)
        attention_before = self.backend.forward_s
        lora = (self.adapters.batch(plan.seqs, self.cache) if self.adapters is not None
                else nullcontext())
        try:
            with self._lock, torch.inference_mode(), lora:
                if self.model.config._attn_implementation != self._attn:
                    use_vmemkv_attention(self.model)   # switched by another engine's thread
                out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                 logits_to_keep=keep_rows, **{STEP_KWARG: self._ctx})
        finally:
            attention = self.backend.forward_s - attention_before
            self.phase_s["attention"] += attention
            self.phase_s["model"] += time.perf_counter() - start - attention
        logits = self._checked_logits(out.logits, len(keep_rows))   # (kept rows, vocab)
        if prompt:
            logits = self._split_prompt_rows(logits, prompt)
        if not sampling:
            return None, []
        return logits, sampling                            # (sampled rows, vocab)

    def _checked_logits(self, logits, rows: int) -> torch.Tensor:
        """The forward's ``logits`` (1, rows, vocab_size) as (rows, vocab_size), or
        LogitsShapeError naming what came back: narrower rows would pick other tokens, wider
        ones ids past the vocabulary, fewer rows another sequence's (nothing is sampled)."""
        want = (1, rows, self.vocab_size)
        if isinstance(logits, torch.Tensor) and logits.is_floating_point() and \
                tuple(logits.shape) == want:
            return logits[0]
        got = (f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise LogitsShapeError(f"the model's forward returned logits {got}; the engine needs a "
                               f"floating-point tensor of shape {want} (batch 1, rows kept this "
                               f"step {rows}, vocab_size {self.vocab_size})")

    def _split_prompt_rows(self, logits: torch.Tensor, prompt: dict) -> torch.Tensor:
        """Keep the prompt sequences' rows in ``prompt_logits``; return the sampled rows."""
        sampled = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        for seq_id, (first_position, begin, end, samples) in prompt.items():
            self.prompt_logits[seq_id] = (first_position, logits[begin:end])
            sampled[begin:end - 1 if samples else end] = False
        return logits[sampled]

    def _inputs(self, plan):
        """begin_step, then (input_ids, positions, rows whose logits are kept, sampling seqs,
        {seq_id in prompt_rows: (first position, first and end kept row, samples)})."""
        step = self.cache.begin_step([(s.seq_id, s.num_computed_tokens, s.num_new_tokens)
                                      for s in plan.seqs])
        ids: List[int] = []
        keep: List[int] = []
        sampling: List[int] = []
        prompt: Dict[int, tuple] = {}   # seq_id -> (first position, its kept rows, samples)
        for i, s in enumerate(plan.seqs):
            if s.new_token_ids is None:
                raise EngineConfigError(f"sequence {s.seq_id}: the engine needs prompt token ids")
            if s.seq_id in self.prompt_rows:   # every row of this chunk is kept
                prompt[s.seq_id] = (s.num_computed_tokens, len(keep),
                                    len(keep) + s.num_new_tokens, s.sample)
                keep.extend(range(len(ids), len(ids) + s.num_new_tokens))
            elif s.sample:
                keep.append(len(ids) + s.num_new_tokens - 1)
            ids.extend(s.new_token_ids)
            if s.sample:
                sampling.append(i)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device).unsqueeze(0)  # (1, T)
        positions = step.positions.to(self.device).unsqueeze(0)                            # (1, T)
        if not keep:   # only non-final prefill chunks: K/V are written, nothing is sampled
            keep_rows = torch.tensor([len(ids) - 1], device=self.device)
        else:
            keep_rows = torch.tensor(keep, device=self.device)
        return input_ids, positions, keep_rows, sampling, prompt
