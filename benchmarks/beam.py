"""Beam search's memory: pages / blocks the beams hold with copy-on-write sharing against each
beam holding a private copy, read from the real caches every step, beside the PagedAttention
paper's 37.6-55.2% saved for beam search (Kwon et al. 2023, Fig. 15, Alpaca, widths 2-6).

    python -m vmemkv.benchmarks.beam [--model tiny-llama|smollm2-135m-instruct] [--out beam.json]
    python -m vmemkv.benchmarks.beam --model smollm2-geometry --page-bytes 2MiB --block-sizes 16
    python -m vmemkv.benchmarks.beam --simulate 300 [--cache-gb 20]   # the simulator's throughput
    python -m vmemkv.benchmarks.beam --simulate-memory 300 --cache-gb 60   # its memory saved

Workload (fixed seed): 8 prompts of 16-24 tokens (Alpaca's inputs are short), beam search to
``--new-tokens`` (64) tokens per beam, ignore_eos, run through ``Engine.beam_search`` step by
step. After every step, from the cache (never the manager):

- shared  = distinct units the live beams map: vmem pool pages under their slots
            (``mapped_extents``), paged blocks in their block tables;
- private = the same units counted once per beam that maps them: what the same beams hold
            when each keeps a private copy of its history (page / block granularity as
            configured), so both sides round to the same units;
- saved   = 1 - shared / private, over the whole run (summed over steps: the paper's "memory
            saving") and at the step of peak private memory;
- read when a step's plan is applied (``begin_step``), over every running sequence;
- copy-on-write bytes per step: what the cache copies for the plans' CopyBlock ops (a block's
  tokens x KV bytes per token) and CopyExtent ops (the member pages the cache binds the op to:
  as many as the source has mapped, so a page group whose members span several pages and are
  backed as far as their bytes copies the pages written so far, not the whole group).

``--page-bytes 4KiB 16KiB 2MiB``: vmem per-layer and interleaved at each page size (a layout
whose page holds no whole token of the model is skipped); without it, the docs' 4 KiB
per-layer, 16 KiB per-layer and interleaved. ``--block-sizes``: paged (16 4). Every run gets
``cache_bytes`` for every beam held privately (``cache_bytes_for``), so none is preempted (the
``preemptions`` column says so) and a host pool of 2 MiB pages is no bigger than it needs.
``group_tokens``: tokens per page group (vmem) or block (paged), the unit shared and copied.
"""
from __future__ import annotations


import torch

from vmemkv.benchmarks.common import (check_sim_cache_gb, environment, exit_status, format_table,
                                      print_environment, write_json)
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import (NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT,
                                      DistinctValues, parse_bytes, result_file)

KiB, MiB = 1024, 2**20
# the docs' engine table: vmem at 4 KiB and 16 KiB (the run without --page-bytes)
DEFAULT_VMEM = (("vmem", dict(cache="vmem", layout="per-layer", page_bytes=4 * KiB)),
                ("vmem", dict(cache="vmem", layout="per-layer", page_bytes=16 * KiB)),
                ("vmem", dict(cache="vmem", layout="interleaved", page_bytes=16 * KiB)))
BLOCK_SIZES = (16, 4)
CACHES = DEFAULT_VMEM + tuple(("paged", dict(cache="paged", block_size=b)) for b in BLOCK_SIZES)
WIDTHS = (2, 4, 6)
PROMPTS = 8


def caches(page_sizes=None, block_sizes=BLOCK_SIZES) -> tuple:
    """(kind, engine options) of each cache a run measures: vmem per-layer and interleaved at
    each of ``page_sizes`` (None: ``DEFAULT_VMEM``), then paged at each of ``block_sizes``."""
    vmem = DEFAULT_VMEM if page_sizes is None else tuple(
        ("vmem", dict(cache="vmem", layout=layout, page_bytes=size))
        for size in page_sizes for layout in ("per-layer", "interleaved"))
    return vmem + tuple(("paged", dict(cache="paged", block_size=b)) for b in block_sizes)


def size_name(num_bytes: int) -> str:
    """4096 -> '4 KiB', 2097152 -> '2 MiB' (bytes as they are otherwise)."""
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if num_bytes % unit == 0:
            return f"{num_bytes // unit} {name}"
    return f"{num_bytes} B"


def geometry(model, options: dict):
    """The vmem page geometry ``options`` give ``model`` (K/V in the model's dtype), or None
    where the layout's page holds no whole token (such a cache cannot be built)."""
    from vmemkv.runtime.hf.support import kv_shape_of
    from vmemkv.scheduler.errors import ConfigError
    from vmemkv.scheduler.geometry import PageGeometry, PageLayout
    kv = kv_shape_of(model.config)
    layer_bytes = kv["num_kv_heads"] * kv["head_dim"] * next(model.parameters()).element_size()
    try:
        return PageGeometry(PageLayout.parse(options["layout"]), options["page_bytes"],
                            kv["num_layers"], layer_bytes)
    except ConfigError:
        return None


def cache_bytes_for(model, options: dict, max_batch: int, max_tokens: int) -> int:
    """K/V bytes for ``max_batch`` + 1 sequences of ``max_tokens`` each held privately, in the
    cache's units (vmem: the member pages their tokens' bytes need, a page group's at most;
    paged: whole blocks): every beam private fits, so nothing is preempted, and a 2 MiB pool is
    no bigger than the run needs (the host pool is allocated up front)."""
    from vmemkv.runtime.hf.support import kv_shape_of
    kv = kv_shape_of(model.config)
    token_bytes = (2 * kv["num_layers"] * kv["num_kv_heads"] * kv["head_dim"]
                   * next(model.parameters()).element_size())
    if options["cache"] == "paged":
        bs = options["block_size"]
        per_seq = -(-max_tokens // bs) * bs * token_bytes
    else:
        geo = geometry(model, options)
        tpp = geo.tokens_per_page
        full, rest = divmod(max_tokens, tpp)
        pages = full * geo.pages_per_group + (
            geo.num_members * geo.member_pages_for(rest) if rest else 0)
        per_seq = pages * geo.page_bytes
    return (max_batch + 1) * per_seq


def held_units(engine) -> tuple:
    """(distinct units the live sequences map, units summed per sequence), from the cache."""
    cache, seqs = engine.kv.cache, [s.seq_id for s in engine.scheduler.running]
    per_seq = []
    for seq_id in seqs:
        if cache.kind == "vmem":
            extents = cache.mapped_extents(cache.placement(seq_id)).values()
            per_seq.append({p for kinds in extents for pages in kinds.values() for p in pages})
        else:
            per_seq.append({b for table in cache.block_tables(seq_id) for b in table
                            if b is not None})
    return len(set().union(*per_seq)), sum(len(s) for s in per_seq)


def unit_bytes(engine) -> int:
    """Bytes of one unit ``held_units`` counts: a pool page (vmem), a block (paged)."""
    cache = engine.kv.cache
    return cache.page_bytes if cache.kind == "vmem" else (
        cache.block_size * cache.config.bytes_per_token)


def group_tokens(engine) -> int:
    """Tokens of one unit of sharing and copy-on-write: a page group (every layer's member
    pages; vmem) or a block (paged)."""
    cache = engine.kv.cache
    return cache.tokens_per_page if cache.kind == "vmem" else cache.block_size


def bound_copy_bytes(bound, page_bytes: int) -> int:
    """Bytes a vmem cache's bound plan (its ``_bind_ops``: [(op, payload)]) copies: each
    CopyExtent's member pages ({member: [(dst, src) page]}, copy-on-write: as many as the
    source has mapped, each whole) or token bytes ({member: (dst, src, bytes)}, block-granular)."""
    from vmemkv.scheduler.plan import CopyExtent
    return sum(p[2] if isinstance(p, tuple) else len(p) * page_bytes
               for op, payload in bound if type(op) is CopyExtent for p in payload.values())


def run_one(model, prompts, width: int, new_tokens: int, options: dict) -> dict:
    from vmemkv.runtime.engine import BeamSearchParams, Engine
    from vmemkv.scheduler.plan import CopyBlock, CopyExtent
    copies, copied = [], []
    max_batch = len(prompts) * width
    budget = cache_bytes_for(model, options, max_batch, max(map(len, prompts)) + new_tokens)
    with Engine(model, max_batch=max_batch, max_context=256, self_check=False,
                cache_bytes=budget, **options) as engine:
        cache, shared, private = engine.kv.cache, [], []
        execute, begin_step = cache.execute, cache.begin_step
        block_bytes = 0 if cache.kind == "vmem" else cache.block_size * cache.config.bytes_per_token

        def counting(ops):              # copy-on-write ops of every plan, and their bytes
            copies.append(sum(type(op) in (CopyExtent, CopyBlock) for op in ops))
            copied.append(sum(type(op) is CopyBlock for op in ops) * block_bytes)
            return execute(ops)

        if cache.kind == "vmem":        # what the cache copies: read where it binds the plan
            bind = cache._bind_ops

            def binding(bound, journal):
                out = bind(bound, journal)
                copied[-1] += bound_copy_bytes(out, cache.page_bytes)
                return out
            cache._bind_ops = binding

        def measuring(seqs):            # the plan's memory and tables are applied: read them
            s, p = held_units(engine)
            shared.append(s)
            private.append(p)
            return begin_step(seqs)
        cache.execute, cache.begin_step = counting, measuring
        params = BeamSearchParams(width, max_new_tokens=new_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_beam_request(prompt, params, index=i)
        engine.run_until_done()
        peak = max(range(len(private)), key=private.__getitem__)
        return {"shared_units": sum(shared), "private_units": sum(private),
                "peak_shared_units": shared[peak], "peak_private_units": private[peak],
                "unit_bytes": unit_bytes(engine), "group_tokens": group_tokens(engine),
                "steps": len(shared), "copies": sum(copies), "plans": len(copied),
                "cow_bytes_per_step": sum(copied) / max(1, len(copied)),
                "preemptions": engine.scheduler.metrics.num_preemptions}


def build(model_name: str, seed: int = 0):
    from vmemkv.runtime.models import TINY_CONFIGS, build_model, load_model
    return (build_model(model_name, seed=seed) if model_name in TINY_CONFIGS
            else load_model(model_name, dtype=torch.float32)[0])


def measure(model_name: str, new_tokens: int, seed: int = 0, page_sizes=None,
            block_sizes=BLOCK_SIZES, widths=WIDTHS, num_prompts: int = PROMPTS,
            progress=print) -> list:
    import random
    model = build(model_name, seed)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 24))]
               for _ in range(num_prompts)]
    rows = []
    for kind, options in caches(page_sizes, block_sizes):
        if kind == "vmem" and geometry(model, options) is None:
            progress(f"# skipped vmem {options['layout']} at {size_name(options['page_bytes'])}: "
                     f"its page holds no whole token of this model")
            continue
        unit = (f"{size_name(options['page_bytes'])} page {options['layout']}"
                if kind == "vmem" else f"block {options['block_size']}")
        for width in widths:
            r = run_one(model, prompts, width, new_tokens, options)
            rows.append({"cache": kind, "unit": unit, "group_tokens": r["group_tokens"],
                         "beam_width": width,
                         "peak_shared_MiB": round(r["peak_shared_units"] * r["unit_bytes"] / 2**20, 3),
                         "peak_private_MiB": round(r["peak_private_units"] * r["unit_bytes"] / 2**20, 3),
                         "saved_peak": f"{1 - r['peak_shared_units'] / r['peak_private_units']:.1%}",
                         "saved_run": f"{1 - r['shared_units'] / r['private_units']:.1%}",
                         "cow_KiB_per_step": round(r["cow_bytes_per_step"] / KiB, 1),
                         "preemptions": r["preemptions"]})
    return rows


def simulate_rows(requests: int, cache_gb: float, widths=(1, 2, 4, 6), seed: int = 0) -> list:
    """The simulator on the standard workload (``requests`` of it, at most 4096 tokens) on
    ``cache_gb`` of llama-3-8b KV on an H100: request throughput by beam width and policy, and
    each policy's gain over reserve-max (the paper's oracle-reservation baseline is between
    reserve-max and reserve-oracle)."""
    from vmemkv.scheduler.simulator import SimConfig, simulate
    from vmemkv.scheduler.workload import WorkloadSpec, generate
    entries = generate(WorkloadSpec(num_requests=requests, seed=seed))
    rows = []
    for width in widths:
        base = None
        for policy in ("reserve-max", "reserve-oracle", "paged", "vmem"):
            layout = dict(layout="auto") if policy == "vmem" else {}    # the vmem
            r = simulate(entries, SimConfig(policy=policy, cache_bytes=int(cache_gb * 1e9),
                                            beam_width=width, **layout))
            rate = r.num_requests / r.simulated_seconds
            base = base or rate
            rows.append({"beam_width": width, "policy": policy, "req_per_s": round(rate, 3),
                         "vs_reserve_max": f"{rate / base:.2f}x",
                         "preemptions": r.num_preemptions,
                         "mean_batch": round(r.mean_batch, 1)})
    return rows


SIM_CACHES = (("paged-16", dict(policy="paged", block_size=16)),
              ("vmem per-layer 2 MiB", dict(policy="vmem", layout="per-layer")),
              ("vmem interleaved 2 MiB", dict(policy="vmem", layout="interleaved")))


def simulate_memory_rows(requests: int, cache_gb: float, widths=(2, 4, 6), seed: int = 0,
                         progress=print) -> list:
    """The simulator's memory saved by sharing (``SimResult.sharing_saved``: distinct units
    the running sequences hold against each holding a private copy, summed over steps) on the
    standard workload, llama-3-8b on an H100, for beam search and parallel sampling (``n``) of
    each width, on paged-16 and vmem (2 MiB pages, both layouts); with the copy-on-write bytes
    per step and output tokens/s."""
    from vmemkv.scheduler.simulator import SimConfig, simulate
    from vmemkv.scheduler.workload import WorkloadSpec, generate
    entries = generate(WorkloadSpec(num_requests=requests, seed=seed))
    rows = []
    for mode in ("beam", "n"):
        for width in widths:
            for name, options in SIM_CACHES:
                extra = dict(beam_width=width) if mode == "beam" else dict(n=width)
                r = simulate(entries, SimConfig(cache_bytes=int(cache_gb * 1e9), **options, **extra))
                rows.append({"mode": f"{mode} {width}", "cache": name,
                             "saved": f"{r.sharing_saved:.1%}",
                             "copied_MiB_per_step": round(r.copied_kv_bytes / r.num_steps / 2**20, 2),
                             "out_tok_s": round(r.output_tokens_per_s),
                             "preemptions": r.num_preemptions})
                progress(f"# {mode} {width} {name}: saved {r.sharing_saved:.1%}")
    return rows


# the engine run's flags, which the simulator runs (--simulate, --simulate-memory) do not read
ENGINE_FLAGS = {"model": "--model", "new_tokens": "--new-tokens", "prompts": "--prompts",
                "page_bytes": "--page-bytes", "block_sizes": "--block-sizes"}


def _ignored_flag(args) -> str | None:
    """A flag the chosen run would not read, named, or None: each was dropped in silence
    (``--simulate-memory 300 --page-bytes 4KiB`` simulated 2 MiB pages, ``--cache-gb 60``
    without a simulation ran the engine as if not given, ``--simulate 9 --simulate-memory
    9`` ran only the second)."""
    if args.simulate and args.simulate_memory:
        return "--simulate and --simulate-memory are two different runs: give one"
    mode = "--simulate" if args.simulate else "--simulate-memory" if args.simulate_memory else None
    if mode is None:
        return None if args.cache_gb is None else ("--cache-gb sizes the simulator's cache: it "
                                                   "applies with --simulate or --simulate-memory")
    given = [flag for dest, flag in ENGINE_FLAGS.items() if vars(args)[dest] is not None]
    if given:
        return (f"{given[0]} sets the engine run and {mode} runs the simulator "
                f"(llama-3-8b, 2 MiB pages, 16-token blocks), which would ignore it: drop it")
    return None


def _engine_defaults(args) -> None:
    """The engine run's defaults, filled in once ``_ignored_flag`` has read what was given."""
    args.model = args.model or "tiny-llama"
    args.new_tokens = args.new_tokens or 64
    args.prompts = args.prompts or PROMPTS
    args.widths = args.widths or list(WIDTHS)
    args.block_sizes = list(BLOCK_SIZES) if args.block_sizes is None else args.block_sizes


def main(argv=None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="tiny-llama, or a real model "
                        "(smollm2-135m-instruct: the fork/prune pattern of real text)")
    parser.add_argument("--new-tokens", type=POSITIVE_INT, default=None,
                        help="tokens per beam (64)")
    parser.add_argument("--prompts", type=POSITIVE_INT, default=None, help="beam requests (8)")
    parser.add_argument("--widths", type=POSITIVE_INT, nargs="+", default=None,
                        action=DistinctValues, help="beam widths (2 4 6; --simulate: 1 2 4 6)")
    parser.add_argument("--page-bytes", type=parse_bytes, nargs="+", default=None,
                        action=DistinctValues, metavar="SIZE",
                        help="vmem page sizes, each run per-layer and interleaved (e.g. 4KiB "
                             "16KiB 2MiB); default: 4 KiB per-layer, 16 KiB per-layer and "
                             "interleaved")
    parser.add_argument("--block-sizes", type=POSITIVE_INT, nargs="*", default=None,
                        action=DistinctValues,
                        help="paged block sizes (16 4); none: no paged rows")
    parser.add_argument("--out", default=None, type=result_file, help="JSON output path")
    parser.add_argument("--simulate", type=NON_NEGATIVE_INT, metavar="REQUESTS", default=0,
                        help="instead: the simulator's throughput by beam width and policy on "
                             "this many requests of the standard workload")
    parser.add_argument("--simulate-memory", type=NON_NEGATIVE_INT, metavar="REQUESTS", default=0,
                        help="instead: the simulator's memory saved by sharing (beams and n "
                             "samples of widths 2, 4, 6) on this many requests of the standard "
                             "workload")
    parser.add_argument("--cache-gb", type=POSITIVE_FLOAT, default=None, help="with --simulate or "
                        "--simulate-memory (20)")
    args = parser.parse_args(argv)
    problem = _ignored_flag(args)
    if problem:
        parser.error(problem)
    if args.cache_gb is None:
        args.cache_gb = 20.0
    else:       # given, so a simulation runs (_ignored_flag refused it otherwise)
        check_sim_cache_gb(parser, args.cache_gb)
    if args.simulate_memory:
        env = environment(seed=0, warmup=0, repeats=1, requests=args.simulate_memory,
                          cache_gb=args.cache_gb, model="llama-3-8b", gpu="h100")
        print_environment(env)
        rows = simulate_memory_rows(args.simulate_memory, args.cache_gb,
                                    **({} if args.widths is None else dict(widths=args.widths)))
        print(format_table(rows, ["mode", "cache", "saved", "copied_MiB_per_step", "out_tok_s",
                                  "preemptions"]))
        write_json(args.out, {"environment": env, "rows": rows})
        return
    if args.simulate:
        env = environment(seed=0, warmup=0, repeats=1, requests=args.simulate,
                          cache_gb=args.cache_gb, model="llama-3-8b", gpu="h100")
        print_environment(env)
        rows = simulate_rows(args.simulate, args.cache_gb,
                             **({} if args.widths is None else dict(widths=args.widths)))
        print(format_table(rows, ["beam_width", "policy", "req_per_s", "vs_reserve_max",
                                  "preemptions", "mean_batch"]))
        write_json(args.out, {"environment": env, "rows": rows})
        return
    _engine_defaults(args)
    env = environment(seed=0, warmup=0, repeats=1, model=args.model, new_tokens=args.new_tokens,
                      prompts=args.prompts, page_bytes=args.page_bytes,
                      block_sizes=args.block_sizes, widths=args.widths)
    print_environment(env)
    rows = measure(args.model, args.new_tokens, page_sizes=args.page_bytes,
                   block_sizes=tuple(args.block_sizes), widths=tuple(args.widths),
                   num_prompts=args.prompts)
    print(format_table(rows, ["cache", "unit", "group_tokens", "beam_width", "peak_shared_MiB",
                              "peak_private_MiB", "saved_peak", "saved_run", "cow_KiB_per_step",
                              "preemptions"]))
    write_json(args.out, {"environment": env, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(exit_status("beam", main))
