"""``vmemkv generate``: run the engine on prompts from a file or stdin, print the completions.

    vmemkv generate --model tiny-llama --prompts prompts.txt --cache vmem --max-new-tokens 32
    echo "1 2 3 4" | vmemkv generate --model tiny-llama --cache paged --block-size 16

One prompt per non-empty line: space-separated token ids, or text when the checkpoint has a
tokenizer. Completions go to stdout, one line per sample, in prompt order (``--json``: one JSON
object per request); the progress bar and the summary (throughput, memory) go to stderr.
"""
from __future__ import annotations

import json
import sys
from typing import List, Union

from vmemkv.scheduler.progress import Progress


class GenerateUsageError(ValueError):
    """A bad input to ``vmemkv generate`` (prompt file, prompt text without a tokenizer)."""


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate with the engine on a vmem or paged cache",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama",
                   help="a built-in random-weight model (tiny-llama, tiny-qwen2, small-llama) "
                        "or a local checkpoint directory")
    p.add_argument("--prompts", default="-", help="prompt file, one per line ('-': stdin); a line "
                   "of space-separated integers is token ids, any other line is text")
    p.add_argument("--text", action="store_true",
                   help="read every line as text, even one made only of digits (needs a tokenizer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="model dtype (default: float32 for built-ins, the checkpoint's otherwise)")
    p.add_argument("--seed", type=int, default=0, help="weights of built-ins, and sampling")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    p.add_argument("--no-progress", action="store_true")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--n", type=int, default=1, help="samples per prompt (forked)")
    s.add_argument("--stop", type=int, nargs="*", default=[], help="stop token ids")
    s.add_argument("--ignore-eos", action="store_true")
    c = p.add_argument_group("cache and scheduling")
    c.add_argument("--cache", choices=["vmem", "paged"], default="vmem")
    c.add_argument("--layout", choices=["per-layer", "interleaved"], default="per-layer")
    c.add_argument("--page-bytes", type=int, default=None)
    c.add_argument("--block-size", type=int, default=16, help="paged: tokens per block")
    c.add_argument("--max-batch", type=int, default=8)
    c.add_argument("--max-context", type=int, default=1024)
    c.add_argument("--cache-bytes", type=int, default=None)
    c.add_argument("--attention", default=None, help="backend name (default: the fastest)")
    c.add_argument("--preemption", choices=["recompute", "swap"], default="recompute")
    c.add_argument("--swap-bytes", type=int, default=0)
    c.add_argument("--watermark", type=float, default=0.0)
    c.add_argument("--prefix-sharing", action="store_true")
    c.add_argument("--background-mapper", action="store_true")


def read_prompts(path: str, has_tokenizer: bool, text_only: bool = False) -> List[Union[List[int], str]]:
    """Non-empty lines of ``path`` (or stdin): token-id lists, or text with a tokenizer
    (every line is text when ``text_only``)."""
    if text_only and not has_tokenizer:
        raise GenerateUsageError("--text needs a model with a tokenizer; this one has none")
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as error:
        raise GenerateUsageError(f"cannot read prompts from {path!r}: {error.strerror}") from None
    prompts: List[Union[List[int], str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        parts = line.split()
        if not text_only and all(p.isdigit() for p in parts):
            prompts.append([int(p) for p in parts])
        elif has_tokenizer:
            prompts.append(line)
        else:
            raise GenerateUsageError(f"prompt line {number} is not space-separated token ids and "
                                     f"the model has no tokenizer: {line[:40]!r}")
    if not prompts:
        raise GenerateUsageError(f"no prompts in {'stdin' if path == '-' else path!r}")
    return prompts


def _check_device(device: str) -> None:
    import torch
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise GenerateUsageError(f"--device must be 'cpu' or 'cuda[:i]', got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise GenerateUsageError(f"--device {device!r} asked for, but no CUDA GPU is visible to torch")


def run(args) -> int:
    import torch

    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.models import load_model

    _check_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer = load_model(args.model, seed=args.seed, dtype=dtype, device=args.device)
    prompts = read_prompts(args.prompts, tokenizer is not None, args.text)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, n=args.n, seed=None,
                            stop_token_ids=tuple(args.stop), ignore_eos=args.ignore_eos)
    engine = Engine(model, tokenizer, cache=args.cache, layout=args.layout,
                    page_bytes=args.page_bytes, block_size=args.block_size,
                    max_batch=args.max_batch, max_context=args.max_context,
                    cache_bytes=args.cache_bytes, attention=args.attention,
                    preemption=args.preemption, swap_bytes=args.swap_bytes,
                    watermark=args.watermark, prefix_sharing=args.prefix_sharing,
                    background_mapper=args.background_mapper, seed=args.seed)
    with engine, Progress(len(prompts) * args.n, desc="samples",
                          enabled=False if args.no_progress else None) as bar:
        outputs = engine.generate(prompts, params,
                                  on_token=lambda ev: bar.update(1) if ev.finished else None)
    for out in outputs:
        _print_output(out, args.json)
    stats = engine.last_stats
    sys.stderr.write(f"vmemkv generate: {stats.summary()}\n")
    return 0


def _print_output(out, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"request_id": out.request_id, "prompt": out.prompt,
                          "prompt_token_ids": list(out.prompt_token_ids),
                          "outputs": [{"index": o.index, "token_ids": o.token_ids, "text": o.text,
                                       "finish_reason": o.finish_reason} for o in out.outputs]}))
        return
    for o in out.outputs:
        print(o.text if o.text is not None else " ".join(map(str, o.token_ids)))
