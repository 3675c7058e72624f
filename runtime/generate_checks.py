"""The checks of ``vmemkv generate``'s and ``vmemkv serve``'s flags (runtime/generate_cli.py):
the refusals the flags alone decide, before the model loads, and --page-bytes against the loaded
model's pages, before the engine is built. Each raises GenerateUsageError naming the flag (one
line, exit 2), or the typed error of the library check it runs (TensorParallelConfigError,
CacheTooLargeError)."""
from __future__ import annotations

import dataclasses

from vmemkv.scheduler.managers.eviction import DEFAULT_EVICTION
from vmemkv.scheduler.presets import KV_CACHE_DTYPE_BYTES

from .generate_io import GenerateUsageError


def check_tp_devices(tp_devices, tp_size, device: str, error=None) -> None:
    """Before any model is loaded: ``error`` (default GenerateUsageError) naming the value when
    ``--tp-devices`` comes without ``--tp`` N > 1 (``tp_size`` None: no --tp) or for a model not
    on a GPU; then the API's own rules and messages for ``tp_devices`` (placement.place_ranks:
    TensorParallelConfigError) against the GPUs visible here."""
    if tp_devices is None:
        return
    error, shown = error or GenerateUsageError, ",".join(map(str, tp_devices))
    if tp_size is None or tp_size < 2:
        raise error(f"--tp-devices {shown} sets the devices of tensor-parallel ranks but "
                    f"{'--tp is not given' if tp_size is None else f'--tp is {tp_size}'}: give "
                    f"--tp N with N > 1, one device per rank")
    import torch
    if torch.device(device).type != "cuda":
        raise error(f"--tp-devices {shown} places ranks on GPUs but the model runs on {device}, "
                    f"where every rank runs on the cpu: drop --tp-devices or use --device cuda")
    from vmemkv.runtime.distributed.placement import place_ranks
    place_ranks(device, tp_size, tp_devices, visible_cuda=torch.cuda.device_count())


def check_device(device: str) -> None:
    """--device by the rule ``load_model`` checks its ``device`` by (``models.checked_device``:
    cpu, or a CUDA GPU torch sees), GenerateUsageError naming the flag."""
    from .models import checked_device
    checked_device(device, "--device", GenerateUsageError)


# what the flags that default to None ("not given") mean when they are not given
FLAG_DEFAULTS = {"layout": "per-layer", "block_size": 16, "background_mapper": False,
                 "prefix_eviction": DEFAULT_EVICTION}


def check_flags(args) -> None:
    """Every refusal the flags alone decide (GenerateUsageError naming the flag, exit 2), before
    the model loads; then the flags not given take their ``FLAG_DEFAULTS``."""
    _check_applies(args)
    for name, value in FLAG_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    from .engine.config import check_block_size      # the engine's own rule, named by flag
    check_block_size(args.cache, args.block_size, args.max_context,
                     ("--block-size", "--max-context"), GenerateUsageError)
    _check_limits(args)
    check_tp_devices(args.tp_devices, args.tensor_parallel_size, args.device)
    if args.tp_timeout_s is not None and (args.tensor_parallel_size or 1) < 2:
        raise GenerateUsageError(f"--tp-timeout-s {args.tp_timeout_s:g} bounds how long a step "
                                 f"waits for tensor-parallel ranks, but there are none without "
                                 f"--tp N (N > 1): give --tp N or drop --tp-timeout-s")
    if args.kv_scales is not None and KV_CACHE_DTYPE_BYTES[args.kv_cache_dtype] != 1:
        raise GenerateUsageError(f"--kv-scales applies to an 8-bit --kv-cache-dtype (fp8_e4m3, "
                                 f"fp8_e5m2, int8), not {args.kv_cache_dtype}")
    if KV_CACHE_DTYPE_BYTES[args.kv_cache_dtype] == 1 and args.device.partition(":")[0] == "cuda":
        # CacheConfig's own rule, refused by it only once the model had loaded onto the GPU
        raise GenerateUsageError(f"--kv-cache-dtype {args.kv_cache_dtype} runs on the CPU only (no "
                                 f"CUDA attention reads 8-bit K/V) and --device is {args.device}: "
                                 f"give --device cpu, or --kv-cache-dtype auto, bf16 or fp16")
    if args.preemption == "swap" and not args.swap_bytes:
        raise GenerateUsageError("--preemption swap moves preempted sequences to host swap "
                                 "space: give --swap-bytes SIZE (> 0)")
    if args.background_mapper and args.tensor_parallel_size > 1:
        raise GenerateUsageError(f"--background-mapper is not supported with --tp "
                                 f"{args.tensor_parallel_size} (every rank applies each plan "
                                 f"inline so that all or none do)")


def _check_applies(args) -> None:
    """A flag given where it has no effect (it was accepted and ignored): refused by name."""
    if args.cache == "paged":
        for flag, value in (("--layout", args.layout), ("--page-bytes", args.page_bytes),
                            ("--background-mapper", args.background_mapper),
                            ("--max-cache-bytes", args.max_cache_bytes)):
            if value is not None:
                raise GenerateUsageError(f"{flag} applies to --cache vmem only; with --cache "
                                         f"paged it would do nothing: drop it")
    elif args.block_size is not None and not args.prefix_sharing:
        raise GenerateUsageError(f"--block-size {args.block_size} sets a paged cache's blocks, or "
                                 f"with --prefix-sharing a vmem cache's prefix-hit blocks; "
                                 f"--cache vmem without --prefix-sharing has none: drop it")
    if args.prefix_eviction is not None and not args.prefix_sharing:
        raise GenerateUsageError(f"--prefix-eviction {args.prefix_eviction} applies with "
                                 f"--prefix-sharing only (no prefix is kept without it): add "
                                 f"--prefix-sharing or drop it")
    if args.swap_bytes and args.preemption != "swap":
        raise GenerateUsageError(f"--swap-bytes {args.swap_bytes} is the host swap space of "
                                 f"--preemption swap; with --preemption {args.preemption} no "
                                 f"sequence swaps and it would only hold host memory aside: add "
                                 f"--preemption swap or drop it")


def _check_limits(args) -> None:
    """The engine's own limits on --max-batch and --max-context (CacheConfig's and
    EngineConfig's) and generate's --n (SamplingParams'), checked against its classes before
    the model is built, the messages naming the flag (not a config field the user never typed)."""
    from vmemkv.runtime.config import CacheConfig
    from vmemkv.runtime.engine import EngineConfig, EngineConfigError
    from vmemkv.runtime.engine.sampling import MAX_SAMPLES
    from vmemkv.runtime.errors import CacheConfigError
    probes = (("--max-batch", args.max_batch, lambda: CacheConfig(  # a one-head probe
                   num_layers=1, num_kv_heads=1, head_dim=1, max_batch=args.max_batch)),
              ("--max-context", args.max_context, lambda: (CacheConfig(
                   num_layers=1, num_kv_heads=1, head_dim=1, max_context=args.max_context),
                  EngineConfig(max_context=args.max_context))))
    for flag, value, probe in probes:    # --max-batch 100000, --max-context 1
        try:
            probe()
        except (CacheConfigError, EngineConfigError) as error:
            raise GenerateUsageError(f"{flag} {value} is outside what the engine takes "
                                     f"({error})") from None
    if getattr(args, "n", 1) > MAX_SAMPLES:      # generate's flag (serve's requests say theirs)
        raise GenerateUsageError(f"--n {args.n} samples per prompt is more than the "
                                 f"{MAX_SAMPLES} a request may fork")


# SamplingParams' fields, as generate's flags name them
SAMPLING_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                  "top_k": "--top-k", "top_p": "--top-p", "n": "--n", "stop": "--stop",
                  "stop_token_ids": "--stop-token-id", "ignore_eos": "--ignore-eos"}
# the flags that only shape a draw, with the value that leaves it as it is
SAMPLING_ONLY_FLAGS = (("top_k", 0), ("top_p", 1.0))


def sampling_params(args):
    """generate's SamplingParams, built from its flags before the model loads: a value the
    engine refuses, or a sampling-only flag (--top-k, --top-p) at a greedy --temperature (the
    default 0, where it would do nothing), is GenerateUsageError naming the flag."""
    from .engine.errors import EngineConfigError
    from .engine.sampling import SAMPLING_EPS, SamplingParams
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, n=args.n, seed=None,
                                stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
                                ignore_eos=args.ignore_eos)
    except EngineConfigError as error:
        raise GenerateUsageError(_named_by_flag(str(error))) from None
    for field, unchanged in SAMPLING_ONLY_FLAGS:
        value = getattr(params, field)
        if params.greedy and value != unchanged:
            raise GenerateUsageError(
                f"{SAMPLING_FLAGS[field]} {value:g} applies when sampling, and --temperature "
                f"{params.temperature:g} (below {SAMPLING_EPS:g}) decodes greedily, where it "
                f"would do nothing: give --temperature above 0 or drop it")
    return params


def _named_by_flag(message: str) -> str:
    """SamplingParams' "SamplingParams.FIELD must be ..." naming the flag that set FIELD."""
    for field, flag in SAMPLING_FLAGS.items():
        start = f"SamplingParams.{field} "
        if message.startswith(start):
            return flag + message[len(start) - 1:]
    return message


def check_page_bytes(args, model) -> None:
    """With --page-bytes on a vmem cache, after the model loads and before the engine is built:
    a slot is whole pages, so --max-context is built rounded up to them. A page so large that
    the rounded context passes the cache's limit, or (no --cache-bytes or
    --memory-utilization) that --max-batch slots of it need more than the device has, is
    refused naming --page-bytes (the engine would blame max_context or cache_bytes, values the
    user never gave). Configurations the engine refuses for other reasons are left to it."""
    if args.cache != "vmem" or args.page_bytes is None:
        return
    from vmemkv.runtime.engine import EngineConfigError
    from vmemkv.runtime.engine.config import page_rounded_context, resolved_layout
    from vmemkv.runtime.errors import CacheConfigError
    from vmemkv.runtime.memory import check_fits_device
    param = next(model.parameters())
    try:   # on the default page: no rounding yet
        cfg, probe = _rank_cache(args, model)
        cfg = resolved_layout(dataclasses.replace(cfg, page_bytes=args.page_bytes), probe)
        rounded = page_rounded_context(probe, cfg, args.max_context)
    except (CacheConfigError, EngineConfigError, ValueError):
        return
    if rounded == args.max_context:
        return
    what = (f"--page-bytes {args.page_bytes} rounds each slot's --max-context "
            f"{args.max_context} tokens up to {rounded} (a slot is whole {cfg.layout} pages)")
    try:
        rounded_config = dataclasses.replace(probe, max_context=rounded)
    except CacheConfigError as error:
        raise GenerateUsageError(f"{what}, more than a cache holds ({error}): give a smaller "
                                 f"--page-bytes") from None
    if args.cache_bytes is None and args.memory_utilization is None:
        check_fits_device(f"the KV cache of {what}, for --max-batch {args.max_batch} slots",
                          args.max_batch * rounded * rounded_config.bytes_per_token, param.device,
                          remedy="give a smaller --page-bytes, or --cache-bytes")


def _rank_cache(args, model):
    """(EngineConfig, CacheConfig) of one rank's cache (the whole one without --tp) for the
    flags, on the default page; the library's errors pass through."""
    from vmemkv.runtime.engine import EngineConfig
    from vmemkv.runtime.engine.config import cache_config_for
    from vmemkv.runtime.engine.tensor_parallel import kv_heads_per_rank
    world = args.tensor_parallel_size
    cfg = EngineConfig(cache=args.cache, layout=args.layout, max_batch=args.max_batch,
                       max_context=args.max_context, kv_cache_dtype=args.kv_cache_dtype)
    return cfg, cache_config_for(model, cfg, next(model.parameters()),
                                 kv_heads_per_rank(model.config, world) if world > 1 else None)


def check_swap_bytes(args, model) -> None:
    """After the model loads, before the engine is built: with --preemption swap, a
    --swap-bytes below one token's K/V of every layer (one rank's with --tp; swap space is
    counted in such tokens) holds no token, so no sequence could ever swap out: refused naming
    the flag (the engine took it, and every preemption fell back to recomputing)."""
    if args.preemption != "swap":
        return
    from vmemkv.runtime.engine import EngineConfigError
    from vmemkv.runtime.errors import CacheConfigError
    try:
        bytes_per_token = _rank_cache(args, model)[1].bytes_per_token
    except (CacheConfigError, EngineConfigError, ValueError):   # the engine's to refuse
        return
    world = args.tensor_parallel_size
    where = f" on a rank (--tp {world}: each has --swap-bytes)" if world > 1 else " here"
    if args.swap_bytes < bytes_per_token:
        raise GenerateUsageError(f"--swap-bytes {args.swap_bytes} holds no token: one token's "
                                 f"K/V of every layer is {bytes_per_token} bytes{where}, so no "
                                 f"sequence could swap out: give at least a sequence's worth "
                                 f"(--max-context {args.max_context} tokens: "
                                 f"{args.max_context * bytes_per_token} bytes)")


def check_max_cache_bytes(args, model) -> None:
    """After the model loads (its device in use): a --max-cache-bytes above the device's total
    memory is a size the cache can never grow to, while a page id of every page of it is
    reserved now (a 1TiB ceiling on a 24 GiB host built millions of them, for minutes and
    gigabytes): CacheTooLargeError naming the flag. Only the total is checked: the memory
    itself is mapped when the cache grows, and checked then."""
    if args.max_cache_bytes is None:
        return
    from vmemkv.runtime.memory import check_fits_device
    check_fits_device(f"--max-cache-bytes {args.max_cache_bytes}", args.max_cache_bytes,
                      next(model.parameters()).device, committed=False,
                      remedy="give a --max-cache-bytes the device can hold")


# the engine's words for what the flags set (its errors name its fields) -> the flags' words:
# (old, new, applies) where applies(args) says the user's flags set what the old words name
FIELD_WORDS = (
    ("; cache_bytes=None)", "; no --cache-bytes: --max-batch slots of --max-context tokens)",
     lambda args: args.cache_bytes is None),
    ("lower cache_bytes (or use memory_utilization)", "lower --max-batch or --max-context, or "
     "give --cache-bytes or --memory-utilization",
     lambda args: args.cache_bytes is None and args.memory_utilization is None),
    ("lower cache_bytes (or use memory_utilization)", "lower --cache-bytes (or use "
     "--memory-utilization)", lambda args: args.cache_bytes is not None),
    ("(cache_bytes=", "(--cache-bytes ", lambda args: args.cache_bytes is not None),
    ("bytes: memory_utilization=", "bytes: --memory-utilization ",
     lambda args: args.memory_utilization is not None),
    ("lower cache_bytes (or memory_utilization) or max_tokens_per_step", "lower "
     "--memory-utilization", lambda args: args.memory_utilization is not None),
    ("lower cache_bytes (or memory_utilization) or max_tokens_per_step", "lower --cache-bytes",
     lambda args: args.cache_bytes is not None),
    ("(swap_bytes=", "(--swap-bytes ", lambda args: True),
    ("lower swap_bytes", "lower --swap-bytes", lambda args: True))


def engine_error_named_by_flags(error: Exception, args) -> Exception:
    """An error of the engine's build (a ValueError) naming the flags that set what it blames:
    a budget too small for one page group or block (``cache_bytes=N``) or below a byte
    (``memory_utilization=F``) that --memory-utilization set, GenerateUsageError naming it
    (the user never gave a cache_bytes); a budget or swap space too large for the device, its
    fields as the flags (``FIELD_WORDS``), the error's own type kept. Any other: as it is."""
    message, fraction = str(error), args.memory_utilization
    if fraction is not None and message.startswith("cache_bytes="):
        budget, _, rest = message[len("cache_bytes="):].partition(" ")
        return GenerateUsageError(f"--memory-utilization {fraction:g} gives the KV cache {budget} "
                                  f"bytes of the device's available memory, which {rest}: give "
                                  f"a larger fraction, or --cache-bytes")
    if fraction is not None and message.startswith("memory_utilization="):
        rest = message[len("memory_utilization="):].partition(" ")[2]
        return GenerateUsageError(f"--memory-utilization {fraction:g} {rest}"
                                  .replace("or cache_bytes", "or --cache-bytes"))
    named = message
    for old, new, applies in FIELD_WORDS:
        if applies(args):
            named = named.replace(old, new)
    if named != message and error.args:
        error.args = (named,) + error.args[1:]
    return error


def check_stop_token_ids(stop_token_ids, model) -> None:
    """After the model loads: --stop-token-id past its vocabulary (the rule
    ``check_request_params`` applies to every request) refused naming the flag; the engine
    blamed "prompt line 1", whatever the prompts were."""
    vocab_size = model.config.get_text_config().vocab_size
    bad = [t for t in stop_token_ids if t >= vocab_size]
    if bad:
        raise GenerateUsageError(f"--stop-token-id {bad[0]} is outside the model's vocabulary "
                                 f"[0, {vocab_size}): such a token is never sampled")


def check_prompt_text_fits(text: str, tokenizer, max_context: int, max_new_tokens: int,
                           index: int) -> None:
    """Before prompt ``index``'s ``text`` (a text line, or a conversation rendered by the chat
    template) is tokenized: RequestRejectedError, the engine's own refusal of its length, when
    it provably holds more tokens than --max-context leaves beside --max-new-tokens (the
    engine admits prompt + max_new_tokens <= max_context: ``serve/text_bounds``' fewest
    tokens, a byte-level BPE's bound). Nothing when the tokenizer gives no bound or the text
    may fit: it is tokenized and checked by the engine as before."""
    from vmemkv.runtime.engine.errors import RequestRejectedError
    from vmemkv.runtime.serve.text_bounds import fewest_tokens, most_chars_per_token
    fewest = fewest_tokens(text, tokenizer)
    if fewest is None or fewest + max_new_tokens <= max_context:
        return
    raise RequestRejectedError(
        f"prompt {index} rejected: at least {fewest} prompt tokens ({len(text):,} characters, "
        f"at most {most_chars_per_token(tokenizer)} a token; found without tokenizing it) + "
        f"{max_new_tokens} new tokens exceed the {max_context} tokens one sequence may hold "
        f"(--max-context {max_context})", index)
