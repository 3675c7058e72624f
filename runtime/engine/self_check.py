"""The engine's construction-time self-check: a short prompt through our attention vs the model's.

    ours       prefill 40 tokens (fewer under a shorter max_context: _prompt), then 2 greedy
               decode steps, on a throwaway cache of the engine's kind (vmem or paged) and
               backend, through ModelRunner
    reference  one forward of prompt + the tokens we chose, with the model's own attention
               (its attn_implementation before the engine; sdpa if it is already ours)
    compare    logits at the 3 sampled positions: max |ours - ref| <= rtol * max |ref|

With tensor parallelism the same check runs a second time after the ranks are built
(``sharded_difference``): "ours" is then the sharded forward of every rank (rank 0's
``TensorParallel.execute``) on the engine's own caches, which it leaves empty, against the
unsharded model on rank 0.

The decode steps are what catch a model whose attention never reaches our function (each step
would attend only to its own token); the prefill alone would look right. A mismatch, or an
error raised inside the model on our path, refuses the model (UnsupportedModelError) before the
engine's cache is built. The whole check holds the model's ``model_lock``: another engine
already running this model on another thread waits for it between forwards (it switches the
model-wide attention implementation). Cost: 4 model forwards of at most 42 tokens
(docs/models.md). The 40 prompt tokens fill cpu-varlen's items of 64 query rows at any
heads-per-KV-head ratio, so a kernel computing some rows wrong (it once did on 8-lane CPUs,
from row 32 on, and 6 tokens passed) is refused here instead of answering wrong.
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch

from vmemkv.runtime.kv import make_kv
from vmemkv.runtime.errors import RuntimeKVError
from vmemkv.runtime.hf.attention import UnsupportedModelError, model_lock, own_attention
from vmemkv.scheduler.layout import CacheKind
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .config import page_rounded_context
from .model_runner import ModelRunner

PROMPT_TOKENS, DECODE_TOKENS = 40, 2   # 40: items of 64 rows, every row vector of the kernel (see _prompt)
RTOL = {torch.float32: 1e-3, torch.float64: 1e-6}   # of the largest reference logit
HALF_RTOL = 3e-2                                     # fp16 / bf16


def self_check(model, cache_config, cfg, backend, original_attn: str) -> None:
    """Refuse ``model`` (UnsupportedModelError) unless our path reproduces its own logits on a
    short prompt. Leaves the model on ``original_attn``, pass or fail; builds and frees its own
    small cache (the engine's is not touched)."""
    prompt = _prompt(model, cfg.max_context)
    # the wiring is checked in the model's own dtype: a kv_cache_dtype's rounding is measured
    # apart (benchmarks/kv_dtype_accuracy.py), its kernel against the reference in the tests
    cache_config = dataclasses.replace(cache_config, kv_cache_dtype="auto", kv_scales=None)
    with model_lock(model):   # its switches wait for (and hold off) other engines' forwards
        try:
            ours, tokens = _our_logits(model, cache_config, cfg, backend, prompt)
            err, allowed = _difference(model, ours, tokens, prompt, original_attn,
                                       cache_config.dtype)
        finally:
            model.set_attn_implementation(original_attn)
    if not err <= allowed:
        raise UnsupportedModelError(
            f"{type(model).__name__} failed the engine's self-check: its logits on vmemkv "
            f"attention differ from its own attention by {err:.3g} (allowed {allowed:.3g}); "
            f"its attention computes something vmemkv does not (self_check=False skips this "
            f"check and is unsafe)")


def sharded_difference(model, kv, execute, dtype, reference, max_context: int
                       ) -> Tuple[float, float]:
    """(largest |sharded - unsharded| logit, the allowed difference) on the self-check's prompt:
    ``execute`` (``TensorParallel.execute``) runs every rank's shard on the caches of ``kv``
    (rank 0's), which hold nothing of it afterwards; the reference is ``model`` itself on
    rank 0, on its own attention (left as it was). ``reference`` (cache_config, engine config,
    backend): instead, ``model`` on our path on one process, on a throwaway cache of that
    config: with a kv_cache_dtype that rounds K/V, the same rounding on both sides. The prompt
    stays within the engine's ``max_context``, as the one-process check's does."""
    with model_lock(model):
        prompt, attn = _prompt(model, max_context), model.config._attn_implementation
        try:
            ours, tokens = _greedy(execute, kv, prompt)
            if reference is None:
                return _difference(model, ours, tokens, prompt, attn, dtype)
            theirs, _ = _our_logits(model, reference[0], reference[1], reference[2], prompt)
            ours, theirs = torch.stack(ours), torch.stack(theirs).to(ours[0].device)
            scale = theirs.abs().max().item() or 1.0
            return (ours - theirs).abs().max().item(), RTOL.get(dtype, HALF_RTOL) * scale
        finally:
            model.set_attn_implementation(attn)


def _prompt(model, max_context: int = PROMPT_TOKENS + DECODE_TOKENS) -> List[int]:
    """PROMPT_TOKENS tokens, fewer where the engine's ``max_context`` is shorter: the check's
    positions (the prompt's and DECODE_TOKENS decodes') stay below ``max_context``, as every
    request's do. Past it, a learned position table of ``max_context`` rows raised IndexError,
    and a dynamic-NTK model whose threshold ``max_context`` respects was refused (its rotary
    frequencies grew in the reference forward, and stayed grown in the model)."""
    vocab = model.config.get_text_config().vocab_size
    length = max(1, min(PROMPT_TOKENS, max_context - DECODE_TOKENS))
    return [(7 * i + 3) % vocab for i in range(length)]


def _difference(model, ours, tokens, prompt, original_attn: str, dtype) -> Tuple[float, float]:
    """(max |ours - reference| over the sampled positions, rtol * max |reference|)."""
    ref = _reference_logits(model, prompt + tokens[:-1], original_attn, len(ours))
    ours = torch.stack(ours).to(ref.device)
    scale = ref.abs().max().item() or 1.0
    return (ours - ref).abs().max().item(), RTOL.get(dtype, HALF_RTOL) * scale


def _our_logits(model, cache_config, cfg, backend, prompt: List[int]):
    """Greedy logits of the prompt's last token and DECODE_TOKENS decode steps, on our path."""
    length = len(prompt) + DECODE_TOKENS + 1
    if CacheKind(cfg.cache) is CacheKind.PAGED:   # whole blocks, so the default budget holds the sequence
        length = -(-length // cfg.block_size) * cfg.block_size
    small = dataclasses.replace(cache_config, max_batch=1, max_context=page_rounded_context(cache_config, cfg, length))
    kv = make_kv(small, cfg.cache, layout=cfg.layout, page_bytes=cfg.page_bytes,
                 block_size=cfg.block_size)   # a bad option raises here, unwrapped
    try:
        return _run(model, kv, backend, prompt, cfg.max_context)
    finally:
        kv.close()


def _greedy(execute, kv, prompt: List[int]):
    """Greedy logits and tokens of one request run through ``execute`` (a plan -> (logits,
    rows) function) on ``kv``; a last plan releases its memory, so ``kv`` ends empty."""
    scheduler = Scheduler(kv.manager, SchedulerConfig(max_running=1, max_tokens_per_step=64),
                          tables=kv.tables)
    scheduler.add_request(Request(0, len(prompt), DECODE_TOKENS + 1, prompt_token_ids=prompt))
    logits, tokens = [], []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        out, rows = execute(plan)
        sampled = {}
        if out is not None:
            logits.append(out[0].float())
            tokens.append(int(out[0].argmax()))
            sampled[plan.seqs[rows[0]].seq_id] = tokens[-1]
        scheduler.update(sampled, now=0.0)
    execute(scheduler.schedule())        # the finished sequence's release
    scheduler.update({}, now=0.0)
    return logits, tokens


def _run(model, kv, backend, prompt: List[int], max_context_tokens: int):
    try:
        runner = ModelRunner(model, kv.cache, backend, max_context_tokens)
        return _greedy(runner.execute, kv, prompt)
    except (RuntimeKVError, RuntimeError, TypeError, ValueError) as error:
        raise UnsupportedModelError(
            f"{type(model).__name__} failed the engine's self-check: running it on vmemkv "
            f"attention raised {type(error).__name__}: {str(error)[:200]}") from error


def _reference_logits(model, ids: List[int], original_attn: str, rows: int) -> torch.Tensor:
    """Logits ``[rows, vocab]`` of the last ``rows`` tokens of ``ids`` in one forward with the
    model's own attention (sdpa when another engine has already switched it to ours)."""
    device = next(model.parameters()).device
    with torch.inference_mode(), own_attention(model, original_attn):
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=False,
                    logits_to_keep=rows)
    return out.logits[0].float()
