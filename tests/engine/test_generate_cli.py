"""`vmemkv generate` end to end, and one-line errors with exit status 2."""
from __future__ import annotations

import io
import json

import pytest

from vmemkv.cli import main

from .conftest import hf_greedy, prompts


def test_generate_from_file_prints_transformers_greedy_tokens(tmp_path, capsys):
    batch = prompts(3, 4, 12, seed=20)
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(" ".join(map(str, p)) for p in batch) + "\n\n")
    rc = main(["generate", "--model", "tiny-llama", "--prompts", str(path), "--max-new-tokens", "6",
               "--cache", "paged", "--block-size", "4", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = [[int(t) for t in line.split()] for line in out.splitlines()]
    assert lines == hf_greedy("tiny-llama", batch, 6)
    assert "tok/s" in err and "MiB" in err


def test_generate_from_stdin_json_with_forks(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n4 5 6 7\n"))
    rc = main(["generate", "--model", "tiny-qwen2", "--max-new-tokens", "4", "--n", "2",
               "--layout", "interleaved", "--json", "--no-progress"])
    out, _ = capsys.readouterr()
    assert rc == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_token_ids"] for r in records] == [[1, 2, 3], [4, 5, 6, 7]]
    assert all(len(r["outputs"]) == 2 for r in records)


@pytest.mark.parametrize("argv, stdin", [
    (["generate", "--cache", "bogus"], "1 2\n"),
    (["generate", "--max-batch", "0"], "1 2\n"),
    (["generate", "--model", "no-such-model-or-dir"], "1 2\n"),
    (["generate"], "not token ids\n"),
    (["generate", "--max-context", "64", "--max-new-tokens", "5000"], "1 2\n"),
    (["generate", "--prompts", "/no/such/file"], ""),
])
def test_user_errors_exit_2_with_one_line(argv, stdin, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    try:
        rc = main(argv)
    except SystemExit as exit_:     # argparse errors
        rc = exit_.code
    _, err = capsys.readouterr()
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
