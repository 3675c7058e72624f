"""Every family of docs/models.md runs as the table says, through Engine and VMemCache, against
plain ``model.generate``: ``exact`` tokens, or a typed refusal whose message names the feature.
Never a wrong answer. (The table is checked here; tests/hf/families.py builds the configs.)"""
from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("transformers")

from .families import EXACT, FAMILIES, outcome  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"


def documented_rows() -> dict:
    text = DOC.read_text()
    block = re.search(r"<!-- families:begin -->(.*)<!-- families:end -->", text, re.S).group(1)
    rows = {}
    for line in block.strip().splitlines()[2:]:           # skip header and rule
        family, cls, engine, cache = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[family] = (cls, engine, cache)
    return rows


def matches(documented: str, result: str) -> bool:
    if documented == EXACT:
        return result == EXACT
    feature = documented.removeprefix("refused: ")
    return result != EXACT and not result.startswith("WRONG") and feature.lower() in result.lower()


def test_the_table_lists_exactly_the_families_tried():
    assert list(documented_rows()) == list(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_exactly_or_is_refused_as_documented(family):
    cls, engine, cache = documented_rows()[family]
    got_cls, got_engine, got_cache = outcome(family)
    assert got_cls == cls
    assert not got_engine.startswith("WRONG") and not got_cache.startswith("WRONG"), (got_engine, got_cache)
    assert matches(engine, got_engine), f"Engine: docs say {engine!r}, got {got_engine!r}"
    assert matches(cache, got_cache), f"VMemCache: docs say {cache!r}, got {got_cache!r}"


def test_the_self_check_is_what_refuses_an_architecture_no_named_check_knows():
    """DiffLlama passes every named check; only the self-check sees that its differential
    attention is not ours. Skipping the check (documented as unsafe) gives wrong tokens."""
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.hf.attention import UnsupportedModelError
    from .families import PROMPT, _reference, build
    import torch
    model = build("diffllama")
    ids = torch.tensor([PROMPT])
    expected = _reference(model, ids, torch.ones_like(ids))[0]
    with pytest.raises(UnsupportedModelError, match="self-check"):
        Engine(model, max_batch=1, max_context=64)
    with Engine(model, max_batch=1, max_context=64, self_check=False) as engine:
        out = engine.generate([PROMPT], SamplingParams(max_new_tokens=len(expected), ignore_eos=True))
    assert out[0].outputs[0].token_ids != expected


@pytest.mark.parametrize("family", ["gpt2", "gpt_bigcode (multi-query)", "opt"])
def test_a_context_past_a_learned_position_table_is_refused_before_anything_runs(family):
    """GPT-2 and OPT learn a row per position: max_context past the table was an IndexError in
    the middle of a step (the whole generate failed); it is refused naming the table."""
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.hf.attention import UnsupportedModelError
    from .families import build
    model = build(family)
    rows = model.config.max_position_embeddings
    with pytest.raises(UnsupportedModelError, match=rf"max_context={rows + 1} exceeds the {rows} "
                                                    r"positions of .* learned position table"):
        Engine(model, max_batch=1, max_context=rows + 1)
    with Engine(model, max_batch=1, max_context=rows) as engine:      # the whole table runs
        out = engine.generate([[1] * (rows - 2)], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert out[0].status == "finished" and len(out[0].outputs[0].token_ids) == 2


def test_a_context_past_a_rotary_models_configured_positions_warns_and_runs():
    """Rotary positions are computed at any length, so such a context runs, as transformers
    runs it; nothing said the model was never trained there."""
    import warnings
    from vmemkv.runtime.engine import Engine
    from .families import build
    model = build("llama")
    trained = model.config.max_position_embeddings
    with pytest.warns(UserWarning, match=rf"max_context={trained + 64} is past the {trained} "
                                         r"positions .* \(max_position_embeddings\)"):
        Engine(model, max_batch=1, max_context=trained + 64).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(model, max_batch=1, max_context=trained).close()
