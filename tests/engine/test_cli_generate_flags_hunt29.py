"""``vmemkv generate``'s flags at the engine's bounds (runtime/generate_checks.py): --max-batch
past CacheConfig's 65536 and --max-context below EngineConfig's 2 are refused naming the flag
before the model loads (the error named ``CacheConfig.max_batch`` / ``EngineConfig.max_context``,
after the load); --stop-token-id past the model's vocabulary is refused naming the flag (the
engine blamed "prompt line 1", whatever the prompts held)."""
from __future__ import annotations

import pytest

from vmemkv.cli import main


def _generate(capsys, tmp_path, *argv) -> tuple:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n4 5 6\n")
    capsys.readouterr()
    code = main(["generate", "--no-progress", "--max-new-tokens", "2", "--prompts",
                 str(prompts), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _no_model_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before a flag the flags alone refuse")
    monkeypatch.setattr("vmemkv.runtime.models.load_model", refuse)


@pytest.mark.parametrize("argv, line", [
    (["--max-batch", "65537"], "--max-batch 65537 is outside what the engine takes "
                               "(CacheConfig.max_batch must be an int in [1, 65536], got 65537)"),
    (["--max-context", "1"], "--max-context 1 is outside what the engine takes "
                             "(EngineConfig.max_context must be an int >= 2, got 1)"),
])
def test_a_bound_the_engine_sets_is_refused_naming_the_flag_before_the_load(
        capsys, tmp_path, monkeypatch, argv, line):
    _no_model_load(monkeypatch)
    code, out, err = _generate(capsys, tmp_path, *argv)
    assert (code, out) == (2, "")
    assert err == f"vmemkv generate: error: GenerateUsageError: {line}\n"


def test_a_stop_token_id_past_the_vocabulary_names_the_flag_not_a_prompt_line(capsys, tmp_path):
    code, out, err = _generate(capsys, tmp_path, "--stop-token-id", "5", "--stop-token-id", "256")
    assert (code, out) == (2, "")    # tiny-llama's vocabulary is [0, 256)
    assert err == ("vmemkv generate: error: GenerateUsageError: --stop-token-id 256 is outside "
                   "the model's vocabulary [0, 256): such a token is never sampled\n")

