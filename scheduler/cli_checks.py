"""``vmemkv simulate``'s checks of its flags together, run before a workload is drawn or run.

Each refuses, with a ConfigError naming the flags (one line, exit 2), what would otherwise run
and be silently wrong or fail late: flags that do not apply together or would do nothing in
the run the others choose (``check_applies``, the flags ``Given`` records), a Poisson rate too low
for the float clock, a ``--write-trace`` path that cannot be written or would be read back
as another format, LoRA budgets that leave no
KV memory. The deployment's own check (``sim_config.check_deployment``) is shared with the sweep.
``profile_defaults`` gives a ``--profile`` run the engine settings the profile was timed with,
after ``check_profile_model`` refused a ``--gpu`` or another ``--model-preset`` beside it, and
``check_profile_copies`` refuses one that copies K/V without ``--copy-gbps`` (a profile has no
GPU to default it from). What depends on a ``--trace``'s hash ids (``trace_shares_prefixes``)
reads the trace only where the answer decides something: a prefix or copy flag given
(``check_trace_sharing``), or a profile run without ``--copy-gbps``.
"""
from __future__ import annotations

import argparse
import os

from .cliargs import file_problem
from .errors import ConfigError
from .geometry import resolve_layout
from .profile_cost import load_profile, profile_engine, profile_model
from .sim_config import SimConfig, check_deployment
from .trace_entry import check_trace_name
from .traces import load_trace
from .workload import MAX_ARRIVAL_S


def flag(key: str) -> str:
    """A setting's flag: ``cache_gb`` -> ``--cache-gb``."""
    return "--" + key.replace("_", "-")


class Given(argparse.Action):
    """A flag stored as usual and noted in ``args.given``: with --profile, the engine settings
    of the flags not given come from the profile (``profile_defaults``), and a flag given where
    the others leave it nothing to do is refused (``check_applies``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


class GivenOnce(Given):
    """``Given`` for a flag whose value is a list (``--slo ttft_p90=2000,tpot_p99=200``,
    ``--seeds 0-4``): the flag given twice is refused while parsing, naming it (argparse kept
    the second list and dropped the first silently: ``--slo ttft_p90=500 --slo tpot_p99=200``
    searched with no TTFT target), as ``DistinctValues`` refuses ``--goodput`` given twice."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.dest in getattr(namespace, "given", ()):
            name = "/".join(self.option_strings)
            parser.error(f"argument {name}: given twice (the second list would replace the "
                         f"first); give every value in one {name}")
        super().__call__(parser, namespace, values, option_string)


# where the prefix and copy flags apply (``_applies_where``; ``check_trace_sharing`` for a trace
# that names no prompt blocks)
PREFIX_SHARED = ("to a --trace whose requests name their prompt blocks (hash ids: the prefixes "
                 "shared)")
COPIES = ("to copy-on-write after --n > 1 or --beam-width > 0 forks and to a --trace's prefix "
          "hits")
GENERATED_WORKLOAD = ("requests", "prompt_median", "prompt_p95", "output_mean", "output_p95",
                      "arrival_rate", "workload_rng")


def _applies_where(args) -> tuple:
    """(flag dests, whether they do anything in this run, where they do, what this run chose
    instead) for every flag that only some configurations use. A custom --policy
    (module:Class) is built with --block-size, --page-bytes, --layout and --swap-gb and may
    map pages, so those apply to it."""
    policy, custom = args.policy, ":" in args.policy
    reserve = policy.startswith("reserve-")      # they hold each sequence's final length
    as_policy = f"--policy {policy}"
    return (
        (("swap_gb",), args.preemption == "swap", "with --preemption swap (its host swap space)",
         f"--preemption {args.preemption}"),
        # a --trace may name adapters: check_trace_adapters reads it where it names none
        (("h2d_gbps",), args.lora_adapters > 0 or args.preemption == "swap" or bool(args.trace),
         "to --lora-adapters' loads and --preemption swap's copies",
         f"--lora-adapters 0 and --preemption {args.preemption}"),
        (("lora_zipf",), args.lora_adapters > 0, "with --lora-adapters N > 0",
         "--lora-adapters 0"),
        (("beam_skew",), args.beam_width > 0, "with --beam-width > 0",
         "--beam-width 0"),
        (("slo", "search_tolerance", "max_probes"), args.find_max_rate, "with --find-max-rate",
         "no --find-max-rate"),
        (("watermark",), args.watermark_scope == "all" or not reserve,
         "to paged and vmem (their sequences grow), and with --watermark-scope all to the reserve "
         "policies", f"{as_policy} and --watermark-scope {args.watermark_scope}"),
        (("watermark_scope",), args.watermark > 0 and (reserve or custom),
         "with --watermark above 0 to a policy holding each sequence's final length (reserve-max, "
         "reserve-oracle)", f"--watermark {args.watermark:g} and {as_policy}"),
        (GENERATED_WORKLOAD, not args.trace, "to a generated workload",
         f"--trace {args.trace} (it replays its own requests and arrivals)"),
        (("seed",), args.seeds is None, "without --seeds (each run draws with its own seed)",
         "--seeds"),
        (("seed",), not args.trace or args.lora_adapters > 0,
         "to a generated workload, and with --trace to --lora-adapters' draw",
         f"--trace {args.trace} and --lora-adapters 0"),
        (("block_size",), policy == "paged" or custom, "to --policy paged (its blocks)", as_policy),
        (("paged_slowdown",), policy == "paged", "to --policy paged (its kernels)", as_policy),
        (("page_size", "layout", "map_latency_us"), policy == "vmem" or custom,
         "to --policy vmem (its pages)", as_policy),
        (("prefix_block_tokens",), policy == "vmem", "to --policy vmem (its prefix hits)",
         as_policy),
        (("prefix_eviction",), policy in ("paged", "vmem"), "to --policy paged and vmem",
         as_policy),
        # a generated workload's prompts share nothing (no hash ids: prefix sharing stays off,
        # simulator._sharing_config), so nothing is kept for eviction and no prefix hit copied
        (("prefix_eviction", "prefix_block_tokens"), bool(args.trace), PREFIX_SHARED,
         "a generated workload (its prompts share no prefix, --n and --beam-width forks "
         "included)"),
        (("copy_gbps",), not reserve, "to --policy paged, vmem and module:Class (their copy "
         "ops)", as_policy),
        (("copy_gbps",), bool(args.trace) or args.n > 1 or args.beam_width > 0, COPIES,
         "a generated workload, --n 1 and --beam-width 0 (nothing is copied)"),
    )


def unused_flags(args) -> dict:
    """Each flag dest that does nothing in the run ``args`` describes -> (where it applies,
    what this run chose instead), from the first rule of ``_applies_where`` that leaves it
    nothing to do; ``vmemkv sweep`` reads its points' keys through it too."""
    unused: dict = {}
    for dests, applies, where, chosen in _applies_where(args):
        if not applies:
            for dest in dests:
                unused.setdefault(dest, (where, chosen))
    return unused


def check_applies(args) -> None:
    """A flag given (``args.given``) where the other flags leave it nothing to do, which would
    be accepted and ignored (docs/usage.md: refused, not ignored): ConfigError naming it, what it
    applies to and what this run chose instead."""
    given = vars(args).get("given", ())
    for dest, (where, chosen) in unused_flags(args).items():
        if dest in given:
            _refuse_unused(args, dest, where, chosen)


def _refuse_unused(args, dest: str, where: str, chosen: str) -> None:
    value = getattr(args, dest)
    shown = f" {value:g}" if isinstance(value, float) else (
        f" {value}" if isinstance(value, (int, str)) else "")
    raise ConfigError(f"{flag(dest)}{shown} applies {where}; with {chosen} it would "
                      f"do nothing: drop it")


def trace_requests(args) -> list:
    """``--trace``'s first ``--max-requests`` requests, arrivals as the file gives them (not
    yet at ``--rate-scale``), read once and kept in ``args.trace_read`` (a copy of ``args``
    shares the dict): a pipe, FIFO or /dev/stdin is read once (the checks' read left the run
    "no requests"), a file once, not once per check, seed and capacity probe."""
    read, key = vars(args).setdefault("trace_read", {}), (args.trace, args.max_requests)
    if key not in read:
        read[key] = load_trace(args.trace, max_requests=args.max_requests)
    return read[key]


def trace_shares_prefixes(args) -> bool:
    """Whether a request of ``--trace`` (its first ``--max-requests``) names its prompt blocks
    (hash ids): only then does the run share prefixes (simulator._sharing_config). Reads the
    trace: the callers ask only when a flag depends on it."""
    return any(e.hash_ids for e in trace_requests(args))


def trace_names_adapters(args) -> bool:
    """Whether a request of ``--trace`` (its first ``--max-requests``) names a LoRA adapter, so
    that a run without ``--lora-adapters`` has adapters to split ``--lora-budget-gb`` for."""
    return any(e.adapter for e in trace_requests(args))


def check_trace_adapters(args) -> None:
    """--h2d-gbps given with a --trace, no --lora-adapters and recompute preemption: it prices
    the loads of the adapters the trace's requests name (it was refused as doing nothing,
    though they were loaded at the default 25 GB/s), and is refused where they name none."""
    if ("h2d_gbps" in vars(args).get("given", ()) and args.trace and not args.lora_adapters
            and args.preemption != "swap" and not trace_names_adapters(args)):
        _refuse_unused(args, "h2d_gbps", "to LoRA adapters' loads (--lora-adapters, or a "
                       "--trace whose requests name adapters) and --preemption swap's copies",
                       f"--trace {args.trace} (no request names an adapter), --lora-adapters "
                       f"0 and --preemption {args.preemption}")


def check_trace_sharing(args) -> None:
    """--prefix-eviction, --prefix-block-tokens, and --copy-gbps without --n or --beam-width
    forks, given (``args.given``) with a --trace none of whose requests has hash ids (Azure's):
    it shares no prefix, so they would do nothing; refused as with a generated workload
    (``check_applies``)."""
    given = vars(args).get("given", ())
    forks = args.n > 1 or args.beam_width > 0      # they copy on a trace of any kind
    wheres = {"prefix_eviction": PREFIX_SHARED, "prefix_block_tokens": PREFIX_SHARED,
              **({} if forks else {"copy_gbps": COPIES})}
    dest = next((d for d in wheres if d in given), None)
    if args.trace and dest and not trace_shares_prefixes(args):
        copies = ", and --n 1 and --beam-width 0 copy nothing" if dest == "copy_gbps" else ""
        _refuse_unused(args, dest, wheres[dest], f"--trace {args.trace} (no request has hash "
                                                 f"ids: it shares no prefix{copies})")


def check_profile_copies(args) -> None:
    """With --profile and no --copy-gbps, a run that copies K/V on the device (copy-on-write
    after --n > 1 or --beam-width > 0 forks, a --trace's prefix hits) on a policy that copies:
    ConfigError naming --copy-gbps. Its default is half the --gpu's memory bandwidth; a profile
    measured no copy bandwidth, and the copies would silently cost 0 s."""
    if args.copy_gbps is not None or args.policy.startswith("reserve-"):
        return
    copies = (f"--n {args.n} (copy-on-write after its forks)" if args.n > 1 else
              f"--beam-width {args.beam_width} (copy-on-write after its forks)"
              if args.beam_width else f"--trace {args.trace} (its prefix hits are copied)"
              if args.trace and trace_shares_prefixes(args) else None)
    if copies:
        raise ConfigError(f"--profile {args.profile} measured no device copy bandwidth, and "
                          f"{copies} copies K/V: give --copy-gbps (GB/s; without --profile it "
                          f"defaults to half the --gpu's memory bandwidth)")


def check_flags(args) -> None:
    """Every check below, in the order the user would fix them."""
    check_lora(args)
    check_applies(args)
    check_trace_sharing(args)
    check_trace_adapters(args)
    check_deployment(model=args.model_preset, gpu=args.gpu, cache_gb=args.cache_gb,
                     preemption=args.preemption, swap_gb=args.swap_gb, policy=args.policy,
                     block_size=args.block_size, max_len=args.max_len, profile=args.profile,
                     name=lambda key: flag(key) + (f" (from {args.profile})" if key in
                                                   vars(args).get("from_profile", ()) else ""))
    check_together(args)
    check_arrival_rate(args)
    if args.write_trace is not None:
        check_writable(args.write_trace, "--write-trace")
        check_trace_name(args.write_trace, "--write-trace")   # what --trace would misread
        check_not_the_trace(args)


def check_not_the_trace(args) -> None:
    """--write-trace naming the file --trace reads (by any path, a link or a hard link too):
    ConfigError naming both. The workload written is the trace as it ran (its first
    --max-requests, scaled to --max-len, arrivals at --rate-scale): it replaced the file,
    silently, and the rest of the trace was lost."""
    trace, path = args.trace, args.write_trace
    if not trace or not os.path.isfile(trace) or not os.path.exists(path):
        return
    if os.path.samefile(trace, path):
        raise ConfigError(f"--write-trace {path} is the file --trace {trace} reads: the "
                          f"workload written (the trace as it runs: --max-requests, --max-len, "
                          f"--rate-scale) would replace it; give another file name")


# a flag's dest -> the profile engine's setting it defaults to, and whether a value above the
# setting (True) or any other value (False) is outside what the profile timed
PROFILE_FLAGS = {"policy": ("cache", False), "page_size": ("page_bytes", False),
                 "layout": ("layout", False), "max_running": ("max_batch", True),
                 "max_tokens_per_step": ("max_tokens_per_step", True),
                 "max_len": ("max_context", True)}


def profile_defaults(args) -> list:
    """With ``--profile``: each engine flag the user did not give (``args.given``) set to the
    setting of the engine the profile timed (``profile_engine``; --page-size and --layout only
    for vmem; --max-len its max_context: what the engine admits, its vmem slots rounded up to
    whole pages as SimConfig.slot_tokens does); the flags given outside what was timed, one line
    each (the caller warns)."""
    if not args.profile:
        return []
    profile = load_profile(args.profile)
    check_profile_model(args, profile)
    engine, given = profile_engine(profile, args.profile), vars(args).get("given", ())
    outside = []
    args.from_profile = set()
    for dest, (key, above) in PROFILE_FLAGS.items():      # --policy first, --max-len last
        if key not in engine or (key in ("page_bytes", "layout") and args.policy != "vmem"):
            continue
        value, timed, what = getattr(args, dest), engine[key], f"{key} {engine[key]}"
        shown = value
        if dest == "max_tokens_per_step" and dest not in given and args.max_running > timed:
            given, value = (*given, dest), args.max_running   # a step must hold every sequence
            setattr(args, dest, value)
            shown = value
        if dest == "layout" and dest in given:       # auto as it resolves for this model
            value = resolve_layout(value, profile_model(profile, args.profile), args.page_size,
                                   on_cuda=True)
            shown = value if value == shown else f"{shown} ({value} here)"
        if dest not in given:
            setattr(args, dest, timed)
            args.from_profile.add(dest)
        elif value > timed if above else value != timed:
            outside.append(f"{flag(dest)} {shown} is {'above' if above else 'not'} the {what} "
                           f"that {args.profile} timed: its step costs are "
                           f"{'extrapolated' if above else 'not measured'} there")
    check_profile_copies(args)          # the policy from the profile's engine, if not given
    return outside


def check_profile_model(args, profile: dict) -> None:
    """With ``--profile``: a ``--model-preset`` other than the profile's model (memory is
    sized, and the steps were timed, for the profile's model: the preset would be dropped, a
    different model's results under its name) and any ``--gpu`` (the profile's measured step
    costs replace the GPU's roofline, as for --prefill-mfu) are refused by flag. A flag counts
    as given when ``args.given`` names it or its value is not the simulator's default."""
    given = vars(args).get("given", ())
    model = profile_model(profile, args.profile).name
    if ("model_preset" in given or args.model_preset != SimConfig.model) \
            and args.model_preset != model:
        raise ConfigError(f"--model-preset {args.model_preset} is not the model {model} that "
                          f"--profile {args.profile} measured: a profile run simulates its own "
                          f"model; leave --model-preset out, or simulate {args.model_preset} "
                          f"without the profile")
    if "gpu" in given or args.gpu != SimConfig.device:
        raise ConfigError(f"--gpu {args.gpu} with --profile {args.profile}: the profile's "
                          f"measured step costs replace the GPU's roofline; leave --gpu out, or "
                          f"simulate without the profile")


def check_lora(args) -> None:
    """--lora-budget-gb needs adapters and must leave KV memory in --cache-gb."""
    if args.lora_budget_gb is None:
        return
    if not args.lora_adapters and not (args.trace and trace_names_adapters(args)):
        raise ConfigError("--lora-budget-gb splits the cache between adapters and KV: give "
                          "--lora-adapters N > 0 (or a --trace whose requests name adapters)")
    if args.lora_budget_gb >= args.cache_gb:
        raise ConfigError(f"--lora-budget-gb {args.lora_budget_gb:g} leaves no KV memory in "
                          f"--cache-gb {args.cache_gb:g}: give less than it")


def check_together(args) -> None:
    """Flags that do not apply to what the others ask for."""
    if args.find_max_rate:
        ignored = [name for name, given in (("--seeds", args.seeds is not None),
                                            ("--write-trace", args.write_trace is not None),
                                            ("--goodput", args.goodput is not None)) if given]
        if ignored:
            raise ConfigError(f"{' and '.join(ignored)} do not apply to --find-max-rate (it "
                              f"runs one seed at loads it picks and reports the highest meeting "
                              f"--slo): run them without --find-max-rate, at the load it finds")
    if args.trace and args.seeds and not args.lora_adapters:   # with it, each seed draws the
        raise ConfigError("--seeds draws generated workloads (or, with --lora-adapters, each "
                          "request's adapter); a --trace replays one fixed workload")
    if args.seeds and len(args.seeds) > 1 and args.write_trace is not None:
        raise ConfigError(f"--write-trace writes one workload and --seeds draws "
                          f"{len(args.seeds)} (only the first seed's was written): give one "
                          f"--seed with --write-trace")
    if not args.trace and (args.rate_scale != 1.0 or args.max_requests is not None):
        raise ConfigError("--rate-scale and --max-requests apply to --trace; for a generated "
                          "workload use --arrival-rate and --requests")


def check_arrival_rate(args) -> None:
    """A Poisson rate so low that the last arrival passes ``MAX_ARRIVAL_S``, where the float
    clock can no longer tell a step's milliseconds apart (5e-324 made every gap infinite)."""
    rate, n = args.arrival_rate, args.requests
    if args.trace or rate == 0 or n <= MAX_ARRIVAL_S * rate:
        return
    raise ConfigError(f"--arrival-rate {rate:g} requests/s puts --requests {n:,} past "
                      f"{MAX_ARRIVAL_S:.0e} s (317 years) of simulated time, where the float clock "
                      f"loses a step's milliseconds: give --arrival-rate >= {n / MAX_ARRIVAL_S:.3g} "
                      f"(or 0: all at time 0)")


def check_writable(path: str, name: str) -> None:
    """ConfigError naming ``name`` unless a result file can be written at ``path``
    (``cliargs.file_problem``: a file name, not a folder or a device, in a folder we may create
    files in)."""
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"{name} {problem}")
