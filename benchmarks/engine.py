"""Engine throughput: our engine on vmem and on paged vs transformers' continuous batching
(``model.generate_batch``, its paged cache), on the same requests; and the share of step time
spent mapping pages, with and without the background mapper.

    python -m vmemkv.benchmarks.engine [--quick] [--device cpu|cuda] [--out bench_out/engine.json]

Set-up: a random-weight Llama-style model (runtime.models "small-llama": 4 layers, hidden 256,
8 query / 2 KV heads; fp32 on the CPU, fp16 on CUDA, where the flash backends want it), 64 requests with prompts of mixed lengths (uniform, fixed seed) and
the same number of new tokens each (generate_batch takes one max_new_tokens), greedy, EOS
ignored. Every system gets the same KV bytes (``kv_budget_bytes``: what the largest
configuration needs for max_batch full sequences; recorded as kv_MiB_every_system). Each configuration: one warm-up run on a few requests, then ``repeats`` timed runs of
all requests; the figure is the median. tokens/s = output tokens / wall time of the whole batch
(prefill included). ``agree`` is the share of requests whose tokens equal vmem's. Systems
run round-robin, one repeat each in turn, so background load on the machine hits all alike;
one torch thread by default (tiny matmuls; steadier on a shared machine).

Each engine row also splits its step time (EngineStats): schedule, plan (memory ops), meta
(begin_step and input tensors), model (the forward minus attention), attn (the backend) and
sample, as shares of step time, and ``overhead`` = the share outside model and attention. The
full run adds the per-request ``sdpa`` rows (the CPU path before ``cpu-varlen``), a "model
forward only" row (``PackedForward``: the model's own forward, its own attention, on the same
packed batches the vmem engine ran, step by step, nothing else; NOT a bound on the engine: each
step's tokens go in as one ``[1, T]`` causal sequence, so its attention is T^2 over all of them,
more work than the engine's per-request attention, and the engine can and does beat it) and
``long_prompts``: 8 requests with
3-4k-token prompts, decode inter-token latency (p50) on vmem and on paged, and ``real_model``:
SmolLM2-135M-Instruct on 32 chat prompts against transformers (benchmarks/real_engine.py) when
it is installed (the reason it is not, otherwise).
"""
from __future__ import annotations

import logging
import random
import statistics
import time

from vmemkv.benchmarks.common import (busy_warnings, environment, exit_status, format_table,
                                      print_environment, write_json)
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.presets import KV_CACHE_DTYPES
from vmemkv.scheduler.cliargs import thread_count, result_file

KiB, MiB = 2**10, 2**20
MODEL = "small-llama"
SEED = 0


# (requests, shortest prompt, longest prompt, new tokens), in requests and tokens
QUICK_WORKLOAD, FULL_WORKLOAD = (64, 8, 64, 8), (64, 16, 256, 64)


def workload(quick: bool) -> dict:
    rng = random.Random(SEED)
    n, low, high, new = QUICK_WORKLOAD if quick else FULL_WORKLOAD
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(low, high))] for _ in range(n)]
    return {"prompts": prompts, "new_tokens": new, "max_batch": 64, "max_context": 512}


def _dtype(device: str):
    import torch
    return torch.float16 if device.startswith("cuda") else torch.float32


def _backends(device: str) -> str:
    """The attention backend the engine picks for each layout here (as in its rows)."""
    from vmemkv.runtime.attention import fastest_backend
    dev = device.split(":")[0]
    return ",".join(f"{layout}:{fastest_backend(layout, dev, 16, dtype=_dtype(device))}"
                    for layout in ("vmem", "paged"))


def _model(device: str):
    from vmemkv.runtime.models import build_model
    model = build_model(MODEL, seed=SEED, dtype=_dtype(device), device=device)
    model.generation_config.eos_token_id = None    # same work for every system: no early EOS
    return model


def kv_budget_bytes(model, work: dict, configs: list[tuple[str, dict]]) -> int:
    """One KV budget for every system: the most any configuration needs to hold ``max_batch``
    full sequences (a vmem slot is whole pages: 2 MiB CUDA pages round small-llama's 512-token
    context up to 16,384 tokens, ~1 GiB, against paged's ~32 MiB). Every engine and
    transformers get exactly these bytes, so no system is measured with more memory."""
    from vmemkv.runtime.engine.config import EngineConfig, cache_config_for
    param = next(model.parameters())
    needs = []
    for _, options in configs:
        cfg = EngineConfig(max_batch=work["max_batch"], max_context=work["max_context"],
                           **{k: v for k, v in options.items() if k != "background_mapper"})
        cc = cache_config_for(model, cfg, param)
        needs.append(cc.max_batch * cc.max_context * cc.bytes_per_token)
    return max(needs)


class EngineSystem:
    """Our engine on one cache configuration; ``once()`` generates the whole workload."""

    def __init__(self, name: str, options: dict, work: dict, device: str, model=None) -> None:
        from vmemkv.runtime.engine import Engine, SamplingParams
        self.name, self.work, self.runs = name, work, []
        self.params = SamplingParams(max_new_tokens=work["new_tokens"], ignore_eos=True)
        self.engine = Engine(model if model is not None else _model(device),
                             max_batch=work["max_batch"], max_context=work["max_context"],
                             cache_bytes=work["kv_bytes"], **options)
        self.engine.generate(work.get("warmup") or work["prompts"][:8], self.params)   # warm-up
        self.batches: list[tuple[int, int]] = []    # (tokens, sampled rows) per step, last run
        execute = self.engine.runner.execute

        def recording(plan):
            self.batches.append((sum(s.num_new_tokens for s in plan.seqs),
                                 sum(1 for s in plan.seqs if s.sample)))
            return execute(plan)
        self.engine.runner.execute = recording

    def once(self) -> None:
        self.batches.clear()
        outs = self.engine.generate(self.work["prompts"], self.params)
        self.runs.append(self.engine.last_stats)
        self.tokens = [o.outputs[0].token_ids for o in outs]

    def row(self) -> dict:
        best = sorted(self.runs, key=lambda s: s.wall_s)[len(self.runs) // 2]   # the median run
        self.engine.close()
        split = {SPLIT_COLUMNS.get(k, k): v for k, v in best.step_split().items()}
        return {"system": self.name, "tok_s": best.tokens_per_s, "wall_s": best.wall_s,
                "steps": best.steps, "kv_MiB": best.cache_bytes / MiB, "kv_peak": best.kv_usage_peak,
                "map_ms": best.mapping_s * 1e3, "map_share": best.mapping_share,
                "attention": best.attention, "tok_s_runs": [s.tokens_per_s for s in self.runs],
                "serving": best.serving,   # scheduler/report.py's figures, wall seconds
                **split, "overhead": best.overhead_share, "itl_p50_ms": _p50(best.itl_s) * 1e3}


SPLIT_COLUMNS = {"metadata": "meta", "attention": "attn"}   # short table headers


def _p50(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


class PackedForward:
    """The model's own forward (its own attention implementation) on the packed batches a vmem
    engine run executed, step by step: [1, tokens] ids, the sampled rows' logits, no cache, no
    scheduling, no sampling. tokens/s = the run's output tokens / that time. Not a limit: the
    [1, T] ids are one causal sequence over all of a step's tokens (T^2 attention), not the
    step's requests, so it does more attention work than the engine."""

    name = "model forward only (packed batch)"

    def __init__(self, batches, output_tokens: int, device: str) -> None:
        import torch
        self.torch, self.batches, self.output_tokens = torch, list(batches), output_tokens
        self.model, self.device, self.times = _model(device), device, []
        gen = torch.Generator().manual_seed(SEED)
        self.ids = [torch.randint(0, 1024, (1, t), generator=gen).to(device) for t, _ in self.batches]
        self.once()                                                   # warm-up
        self.times.clear()

    def once(self) -> None:
        start = time.perf_counter()
        with self.torch.inference_mode():
            for ids, (_, rows) in zip(self.ids, self.batches):
                self.model(input_ids=ids, use_cache=False, logits_to_keep=max(rows, 1))
        self.times.append(time.perf_counter() - start)

    def row(self) -> dict:
        wall = statistics.median(self.times)
        return {"system": self.name, "tok_s": self.output_tokens / wall, "wall_s": wall,
                "steps": len(self.batches), "attention": self.model.config._attn_implementation,
                "tok_s_runs": [self.output_tokens / t for t in self.times]}


def hf_num_blocks(model, kv_bytes: int, block_tokens: int = 256) -> int:
    """transformers' cache blocks (``block_tokens`` each) that fit in ``kv_bytes``."""
    mc = model.config.get_text_config()
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    bytes_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * head_dim * model.dtype.itemsize
    return kv_bytes // (block_tokens * bytes_per_token)


class TransformersSystem:
    """transformers' continuous batching: ``model.generate_batch`` with its paged cache."""

    name = "transformers generate_batch"

    def __init__(self, work: dict, device: str, model=None) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        self.work, self.times = work, []
        self.model = model if model is not None else _model(device)
        self.config = GenerationConfig(max_new_tokens=work["new_tokens"], do_sample=False,
                                       eos_token_id=None)
        # sized like our engine: the same KV bytes (in its 256-token pages), step token budget
        # and batch; by default it sizes its cache from free memory (GBs to allocate per call)
        self.cb = ContinuousBatchingConfig(num_blocks=hf_num_blocks(self.model, work["kv_bytes"]),
                                           max_batch_tokens=2048,
                                           max_requests_per_batch=work["max_batch"])
        self.model.generate_batch(work["prompts"][:8], generation_config=self.config,
                                  continuous_batching_config=self.cb)             # warm-up

    def once(self) -> None:
        start = time.perf_counter()
        result = self.model.generate_batch(self.work["prompts"], generation_config=self.config,
                                           continuous_batching_config=self.cb)
        self.times.append(time.perf_counter() - start)
        self.tokens = [result[f"req_{i}"].generated_tokens for i in range(len(self.work["prompts"]))]

    def row(self) -> dict:
        wall = statistics.median(self.times)
        total = sum(len(t) for t in self.tokens)
        return {"system": self.name, "tok_s": total / wall, "wall_s": wall,
                "attention": self.model.config._attn_implementation,
                "tok_s_runs": [total / t for t in self.times]}


def configurations(quick: bool, device: str = "cpu") -> list[tuple[str, dict]]:
    common = [
        ("vmem per-layer", dict(cache="vmem", layout="per-layer")),
        ("vmem interleaved", dict(cache="vmem", layout="interleaved")),
        ("paged bs16", dict(cache="paged", block_size=16)),
    ]
    if device.startswith("cuda"):   # 2 MiB is the smallest CUDA page: mapping is rare already
        return common + [("vmem per-layer +bg mapper", dict(cache="vmem", background_mapper=True))]
    if not quick:   # the per-request path, to show what one call per layer for the batch buys
        common += [("vmem per-layer sdpa", dict(cache="vmem", layout="per-layer", attention="sdpa")),
                   ("paged bs16 sdpa", dict(cache="paged", block_size=16, attention="sdpa"))]
    return common + [
        # 16 KiB pages (64 tokens): many map ops, to show what mapping costs and what the
        # background mapper hides
        ("vmem 16KiB pages", dict(cache="vmem", page_bytes=16 * KiB)),
        ("vmem 16KiB pages +bg mapper", dict(cache="vmem", page_bytes=16 * KiB, background_mapper=True)),
    ]


TABLE = ["system", "tok_s", "vs_hf", "wall_s", "steps", "kv_MiB", "map_share", "agree",
         "schedule", "plan", "meta", "model", "attn", "sample", "other", "overhead", "attention"]


def measure_systems(work: dict, configs, device: str, repeats: int, packed: bool) -> list[dict]:
    """Rows of every engine configuration, the packed forward (``packed``) and transformers
    (last), the systems taking turns; ``agree`` = share of requests with vmem's tokens."""
    systems = [EngineSystem(name, options, work, device) for name, options in configs]
    hf = TransformersSystem(work, device)
    for _ in range(repeats):       # round-robin: background load hits every system alike
        for system in systems + [hf]:
            system.once()
    rows = [system.row() for system in systems + [hf]]
    for system, row in zip(systems + [hf], rows):
        row["agree"] = sum(a == b for a, b in zip(system.tokens, systems[0].tokens)) / len(system.tokens)
    if packed:   # after the others: it replays the packed batches of the vmem run
        forward = PackedForward(systems[0].batches, systems[0].runs[-1].output_tokens, device)
        for _ in range(repeats):
            forward.once()
        rows.insert(-1, forward.row())
    for r in rows:
        r["vs_hf"] = r["tok_s"] / rows[-1]["tok_s"]
    return rows


def long_prompts(device: str, repeats: int) -> dict:
    """8 requests with 3-4k-token prompts: decode inter-token latency (p50) on vmem and paged,
    with the fastest backend and with per-request sdpa; paged ITL / vmem ITL per backend."""
    rng = random.Random(SEED)
    work = {"prompts": [[rng.randrange(1024) for _ in range(rng.randint(3000, 3968))] for _ in range(8)],
            "new_tokens": 32, "max_batch": 8, "max_context": 4096, "warmup": [[1, 2, 3]] * 8}
    configs = [(f"{cache} {attn}", dict(cache=cache, attention=attn, block_size=16))
               for attn in ("cpu-varlen", "sdpa") for cache in ("vmem", "paged")
               if attn == "sdpa" or not device.startswith("cuda")]
    work["kv_bytes"] = kv_budget_bytes(_model(device), work, configs)
    systems = [EngineSystem(name, options, work, device) for name, options in configs]
    for _ in range(repeats):
        for system in systems:
            system.once()
    rows = [{k: r[k] for k in ("system", "itl_p50_ms", "tok_s", "wall_s", "attn", "overhead")}
            for r in (s.row() for s in systems)]
    by = {r["system"]: r["itl_p50_ms"] for r in rows}
    ratios = {attn: by[f"paged {attn}"] / by[f"vmem {attn}"] for attn in ("cpu-varlen", "sdpa")
              if f"vmem {attn}" in by}
    print(format_table(rows, list(rows[0])))
    print("# long prompts, paged ITL / vmem ITL: " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return {"prompt_tokens": [len(p) for p in work["prompts"]], "new_tokens": work["new_tokens"],
            "rows": rows, "paged_over_vmem_itl": ratios}


def run(quick: bool = False, out: str | None = None, threads: int = 1, device: str = "cpu",
        kv_cache_dtype: str = "auto") -> dict:
    """Run every configuration, print the table, return (and optionally write) the results;
    ``kv_cache_dtype``: every engine system's K/V storage."""
    import torch

    from vmemkv.benchmarks.suite import versions
    torch.set_num_threads(threads)
    warmup, repeats = 1, (1 if quick else 3)
    work = workload(quick)
    configs = [(name, {**options, "kv_cache_dtype": kv_cache_dtype})
               for name, options in configurations(quick, device)]
    work["kv_bytes"] = kv_budget_bytes(_model(device), work, configs)
    env = environment(SEED, warmup, repeats, device=device, model=MODEL, dtype=str(_dtype(device)),
                      requests=len(work["prompts"]),
                      prompt_tokens=sum(map(len, work["prompts"])), new_tokens=work["new_tokens"],
                      threads=torch.get_num_threads(), backends=_backends(device),
                      kv_cache_dtype=kv_cache_dtype,
                      kv_MiB_every_system=work["kv_bytes"] / MiB, **versions(device))
    print_environment(env)
    rows = measure_systems(work, configs, device, repeats, packed=not quick)
    print(format_table(rows, TABLE))
    by = {r["system"]: r for r in rows}
    vmem = by["vmem per-layer"]
    summary = {"engine_vs_transformers": vmem["tok_s"] / rows[-1]["tok_s"],
               "vmem_vs_paged": vmem["tok_s"] / by["paged bs16"]["tok_s"]}
    if PackedForward.name in by:   # a ratio only: PackedForward is no bound on the engine
        summary["engine_vs_packed_forward"] = vmem["tok_s"] / by[PackedForward.name]["tok_s"]
    if "overhead" in vmem:
        summary["vmem_overhead_share"] = vmem["overhead"]   # outside model + attention
    print("# " + "  ".join(f"{k}={v:.3f}" for k, v in summary.items()))
    payload = {"environment": env, "rows": rows, "summary": summary}
    if not quick:
        payload["long_prompts"] = long_prompts(device, repeats=2)
        payload["real_model"] = _real_model(device)
    payload["warnings"] = busy_warnings(env["load_1min"])
    write_json(out, payload)
    return payload


def _real_model(device: str) -> dict:
    """SmolLM2-135M-Instruct on 32 chat prompts (benchmarks/real_engine.py), when installed."""
    from vmemkv.benchmarks import real_engine
    payload = real_engine.run_if_installed(device=device)
    if "skipped" in payload:
        print(f"# real model skipped: {payload['skipped']}")
    else:
        print(format_table(payload["rows"], real_engine.TABLE))
    return payload


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 new tokens, short prompts, 1 repeat")
    parser.add_argument("--out", default=None, type=result_file, help="write the results as JSON here")
    parser.add_argument("--threads", type=thread_count, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="every engine system's K/V storage (default: the model's dtype)")
    args = parser.parse_args(argv)
    run(quick=args.quick, out=args.out, threads=args.threads, device=args.device,
        kv_cache_dtype=args.kv_cache_dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("engine", main))
