"""Tensor parallelism on this CPU: TP=1 against TP=2 engine throughput on the same requests, and
the share of rank 0's step time spent in collectives (plan broadcast, agreement, activation sums).

    python -m vmemkv.benchmarks.tp [--quick] [--out bench_out/tp.json]

Same cores for both: TP=1 runs with ``cores`` torch threads (and, as a second row, one), TP=2
with ``cores / 2`` per rank.
Model "small-llama" (8 query / 2 KV heads: one KV head per rank at TP=2), fp32, greedy, EOS
ignored; each configuration is built once, warmed up on a few requests, then timed ``repeats``
times round-robin; the figure is the median. ``agree``: requests whose tokens equal TP=1's.
"""
from __future__ import annotations

import os
import random
import statistics
import time

from vmemkv.benchmarks.common import (busy_warnings, environment, exit_status, format_table,
                                      print_environment, write_json)
from vmemkv.cli import OneLineArgumentParser
from vmemkv.runtime.generate_cli import tp_device_list
from vmemkv.scheduler.cliargs import bounded, thread_count, result_file

MODEL, SEED = "small-llama", 0
QUICK, FULL = (16, 8, 64, 8), (32, 16, 256, 32)   # requests, shortest, longest prompt, new tokens


def _prompts(quick: bool, vocab_size: int):
    """Random prompts of token ids in [1, min(1024, vocab_size)) (small-llama's whole vocabulary,
    and a smaller model's: ids 1..1023 were refused by --model tiny-llama's 256), new tokens."""
    n, low, high, new = QUICK if quick else FULL
    rng = random.Random(SEED)
    top = min(1024, vocab_size)
    return [[rng.randrange(1, top) for _ in range(rng.randint(low, high))] for _ in range(n)], new


class _Config:
    def __init__(self, tp: int, threads: int, model, prompts, new: int, tp_devices=None) -> None:
        import torch
        from vmemkv.runtime.engine import Engine, SamplingParams
        torch.set_num_threads(threads)
        self.name, self.threads, self.prompts = f"TP={tp} x{threads} thr", threads, prompts
        self.params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        self.start = lambda: Engine(model, max_batch=16, max_context=512, tensor_parallel_size=tp,
                                    self_check=False, tp_devices=tp_devices)
        t0 = time.perf_counter()
        self.engine = self.start()
        self.start_s = time.perf_counter() - t0     # TP: the first in this process starts the
                                                    # rank server (group.rank_context)
        self.engine.generate(prompts[:4], self.params)            # warm-up
        self.walls, self.comm, self.steps, self.tokens = [], [], [], None
        self.per_step = 0.0     # collectives per engine step (TP only)

    def once(self) -> None:
        import torch
        torch.set_num_threads(self.threads)
        tp = self.engine.tp
        calls0 = tp.collectives if tp is not None else 0
        comm0, t0 = self.engine.tp_comm_s, time.perf_counter()
        out = self.engine.generate(self.prompts, self.params)
        self.walls.append(time.perf_counter() - t0)
        if tp is not None:
            self.per_step = (tp.collectives - calls0) / self.engine.last_stats.steps
        self.comm.append(self.engine.tp_comm_s - comm0)
        self.steps.append(self.engine.last_stats.step_s)
        self.tokens = [o.outputs[0].token_ids for o in out]

    def row(self) -> dict:
        wall = statistics.median(self.walls)
        output = sum(len(t) for t in self.tokens)
        comm_share = statistics.median(c / s for c, s in zip(self.comm, self.steps))
        return {"system": self.name, "tok_s": output / wall, "wall_s": wall,
                "comm_share": comm_share, "collectives_per_step": self.per_step,
                "threads_per_rank": self.threads,
                "kv_MiB_per_rank": self.engine.stats().cache_bytes / 2**20}


def _restarts(config: _Config, times: int = 3) -> dict:
    """Seconds to build and to close an engine like ``config``'s once its rank server runs
    (medians of ``times``), beside the first build, which started that server, and the same
    with ranks started by ``spawn`` (a fresh interpreter each, the method before the server)."""
    from vmemkv.runtime.distributed.group import START_METHOD_ENV

    def timed() -> tuple:
        starts, closes = [], []
        for _ in range(times):
            t0 = time.perf_counter()
            engine = config.start()
            t1 = time.perf_counter()
            engine.close()
            starts.append(t1 - t0)
            closes.append(time.perf_counter() - t1)
        return statistics.median(starts), statistics.median(closes)

    again, close = timed()
    before = os.environ.get(START_METHOD_ENV)
    os.environ[START_METHOD_ENV] = "spawn"
    try:
        spawn_start, spawn_close = timed()
    finally:
        if before is None:
            del os.environ[START_METHOD_ENV]
        else:
            os.environ[START_METHOD_ENV] = before
    return {"tp_start_first_s": config.start_s, "tp_start_again_s": again, "tp_close_s": close,
            "tp_start_spawn_s": spawn_start, "tp_close_spawn_s": spawn_close,
            "tp_start_spawn_over_again": spawn_start / again}


def run(quick: bool = False, out: str | None = None, cores: int = 2, world: int = 2,
        device: str = "cpu", tp_devices=None, restarts: bool = True,
        model_name: str = MODEL) -> dict:
    """TP=1 (cores threads, then one) and TP=``world`` (cores / world threads per rank, on
    ``tp_devices``: the engine's ``tp_devices``, None for its default); ``restarts``: then time
    engine starts and closes (``_restarts``)."""
    import torch

    from vmemkv.runtime.models import load_model
    repeats = 1 if quick else 3
    model, _ = load_model(model_name, seed=SEED, dtype=torch.float32, device=device)
    prompts, new = _prompts(quick, model.config.get_text_config().vocab_size)
    env = environment(SEED, 1, repeats, model=model_name, requests=len(prompts), new_tokens=new,
                      cores=cores, load_1min=os.getloadavg()[0])
    print_environment(env)
    configs = [_Config(1, cores, model, prompts, new), _Config(1, 1, model, prompts, new),
               _Config(world, max(1, cores // world), model, prompts, new, tp_devices)]
    try:
        for _ in range(repeats):
            for c in configs:
                c.once()
        rows = [c.row() for c in configs]
        for c, r in zip(configs, rows):
            r["agree"] = sum(a == b for a, b in zip(c.tokens, configs[0].tokens)) / len(c.tokens)
    finally:
        for c in configs:
            c.engine.close()
    starts = _restarts(configs[2], repeats) if restarts else {}   # one TP engine at a time
    print(format_table(rows, ["system", "tok_s", "wall_s", "comm_share", "collectives_per_step",
                              "threads_per_rank", "kv_MiB_per_rank", "agree"]))
    summary = {"tp_vs_tp1": rows[2]["tok_s"] / rows[0]["tok_s"],
               "tp_vs_tp1_one_thread": rows[2]["tok_s"] / rows[1]["tok_s"],
               "tp_comm_share": rows[2]["comm_share"], "tp_size": world,
               "tp_collectives_per_step": rows[2]["collectives_per_step"], **starts}
    print(f"# TP={world} vs TP=1: {summary['tp_vs_tp1']:.2f}x (vs TP=1 on one thread: "
          f"{summary['tp_vs_tp1_one_thread']:.2f}x); communication {summary['tp_comm_share']:.1%} "
          f"of TP={world}'s step time, {summary['tp_collectives_per_step']:.2f} collectives per step")
    if starts:
        print(f"# TP={world} engine start: {starts['tp_start_first_s']:.2f} s the first (it "
              f"starts the rank server), {starts['tp_start_again_s']:.2f} s after, close "
              f"{starts['tp_close_s']:.2f} s; with spawn {starts['tp_start_spawn_s']:.2f} s and "
              f"{starts['tp_close_spawn_s']:.2f} s ({starts['tp_start_spawn_over_again']:.1f}x)")
    payload = {"environment": env, "rows": rows, "summary": summary,
               "warnings": busy_warnings(env["load_1min"])}
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 short requests, 8 tokens, 1 repeat")
    parser.add_argument("--out", default=None, type=result_file, help="write the results as JSON here")
    parser.add_argument("--cores", type=thread_count, default=2, help="cores shared by all ranks")
    parser.add_argument("--tp", type=bounded(int, 2), default=2,
                        help="ranks of the tensor-parallel row (at least 2, as vmemkv bench --tp)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank)")
    parser.add_argument("--tp-devices", type=tp_device_list, default=None,
                        help="the TP row's devices, comma-separated (e.g. cuda:0,cuda:2)")
    parser.add_argument("--model", default=MODEL,
                        help="a built-in name, checkpoint directory or packaged GGUF (fp32)")
    parser.add_argument("--no-restarts", action="store_true",
                        help="skip timing engine starts and closes (forkserver and spawn)")
    args = parser.parse_args(argv)
    run(quick=args.quick, out=args.out, cores=args.cores, world=args.tp, device=args.device,
        tp_devices=args.tp_devices, restarts=not args.no_restarts, model_name=args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("tp", main))
