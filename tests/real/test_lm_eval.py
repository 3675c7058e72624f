"""lm-evaluation-harness against ``vmemkv serve`` on the real model: its ``local-completions``
model (loglikelihood through echo + logprobs, token-id prompts in batches; generate_until) and
``local-chat-completions`` (generate_until through the chat template) score a small task written
into tests/data (a local JSONL, nothing from the hub) exactly as the harness's own ``hf`` model
does, document by document (the same loglikelihoods within 1e-3, the same generated text).
Slow (60 s on a 2-core machine at load 2) and needs the ``eval`` extra (lm-eval): docs/usage.md says how to
run it; CI, which does not install lm-eval, skips it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).resolve().parent.parent / "data" / "lm_eval" / "tiny_qa.jsonl"
MODEL = "smollm2-135m-instruct"
TASKS = """\
task: vmemkv_tiny_qa_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
---
"""


def _write_tasks(tmp_path: Path) -> Path:
    choice = TASKS.split("---")[0].format(data=DATA)
    (tmp_path / "choice.yaml").write_text(choice)
    gen = (choice.replace("vmemkv_tiny_qa_choice", "vmemkv_tiny_qa_gen")
           .replace("output_type: multiple_choice", "output_type: generate_until")
           .replace('doc_to_choice: "{{choices}}"\n', "")
           .replace("doc_to_target: answer", "doc_to_target: short")
           .replace("  - metric: acc", "  - metric: exact_match\n    ignore_case: true\n"
                                       "    ignore_punctuation: true")
           + "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 6\n  do_sample: false\n")
    (tmp_path / "gen.yaml").write_text(gen)
    return tmp_path


def _score(model: str, model_args: dict, task: str, include: Path, chat: bool = False) -> tuple:
    """(the task's metric, each document's responses: loglikelihoods or generated text)."""
    from lm_eval.tasks import TaskManager
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                      task_manager=TaskManager(include_path=str(include)),
                                      batch_size=4 if model != "local-chat-completions" else 1,
                                      apply_chat_template=chat, log_samples=True)
    metrics = results["results"][task]
    metric = next(v for k, v in metrics.items() if k.split(",")[0] in ("acc", "exact_match"))
    docs = sorted(results["samples"][task], key=lambda d: d["doc_id"])
    return float(metric), [d["resps"] for d in docs]


def _same_responses(served: list, hf: list) -> None:
    for a, b in zip(served, hf, strict=True):
        for (x,), (y,) in zip(a, b, strict=True):
            if isinstance(x, str):
                assert x == y
            else:   # (loglikelihood, is_greedy) of one choice
                assert abs(x[0] - y[0]) <= 1e-3 and x[1] == y[1], (x, y)


def test_lm_eval_through_the_server_scores_as_its_hf_model(real_server, real_model_dir, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    include = _write_tasks(tmp_path)
    served = dict(model=MODEL, tokenizer=str(real_model_dir), tokenizer_backend="huggingface",
                  tokenized_requests=True, num_concurrent=1, max_retries=1,
                  base_url=real_server.url + "/v1/completions")
    chat = dict(model=MODEL, base_url=real_server.url + "/v1/chat/completions", num_concurrent=1,
                max_retries=1)
    hf = dict(pretrained=str(real_model_dir), dtype="float32", device="cpu")
    scores = {
        "choice served": _score("local-completions", served, "vmemkv_tiny_qa_choice", include),
        "choice hf": _score("hf", hf, "vmemkv_tiny_qa_choice", include),
        "gen served": _score("local-completions", served, "vmemkv_tiny_qa_gen", include),
        "gen hf": _score("hf", hf, "vmemkv_tiny_qa_gen", include),
        "chat served": _score("local-chat-completions", chat, "vmemkv_tiny_qa_gen", include, True),
        "chat hf": _score("hf", hf, "vmemkv_tiny_qa_gen", include, True),
    }
    print({k: (v[0], v[1][:3]) for k, v in scores.items()})
    for kind in ("choice", "gen", "chat"):
        assert scores[f"{kind} served"][0] == scores[f"{kind} hf"][0], kind
        _same_responses(scores[f"{kind} served"][1], scores[f"{kind} hf"][1])
    assert scores["choice served"][0] > 0.25                              # above chance
    assert any(r[0][0] for r in scores["chat served"][1])                # it said something
