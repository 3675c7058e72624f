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


def _json_with_forks(monkeypatch, capsys) -> dict:
    """Two prompts, n=2, --json: checks the per-request records, returns the stats object."""
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n4 5 6 7\n"))
    rc = main(["generate", "--model", "tiny-qwen2", "--max-new-tokens", "4", "--n", "2",
               "--layout", "interleaved", "--json", "--no-progress"])
    out, _ = capsys.readouterr()
    assert rc == 0
    *records, stats = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_token_ids"] for r in records] == [[1, 2, 3], [4, 5, 6, 7]]
    assert all(len(r["outputs"]) == 2 for r in records)
    assert [o["index"] for r in records for o in r["outputs"]] == [0, 1, 0, 1]
    return stats["stats"]


def test_generate_from_stdin_json_with_forks(monkeypatch, capsys):
    _json_with_forks(monkeypatch, capsys)


def test_json_ends_with_the_runs_stats(monkeypatch, capsys):
    stats = _json_with_forks(monkeypatch, capsys)
    assert stats["output_tokens"] == 2 * 2 * 4 and stats["requests"] == 2
    for key in ("tokens_per_s", "ttft_p50_s", "itl_p50_s", "num_preemptions", "cache_bytes"):
        assert isinstance(stats[key], (int, float)), key
    assert stats["tokens_per_s"] > 0 and stats["num_preemptions"] == 0


def test_each_of_n_samples_is_labelled_with_its_prompt_and_index(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n4 5 6 7\n"))
    assert main(["generate", "--max-new-tokens", "3", "--n", "2", "--temperature", "1",
                 "--no-progress"]) == 0
    labels = [line.split("]")[0] + "]" for line in capsys.readouterr().out.splitlines()]
    assert labels == ["[prompt 0 sample 0]", "[prompt 0 sample 1]", "[prompt 1 sample 0]",
                      "[prompt 1 sample 1]"]


def test_sizes_take_units_and_threads_apply(monkeypatch, capsys):
    import torch
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n"))
    threads = torch.get_num_threads()
    try:
        assert main(["generate", "--page-bytes", "64KiB", "--cache-bytes", "4MiB", "--threads", "1",
                     "--max-new-tokens", "2", "--json", "--no-progress"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])["stats"]
    assert stats["cache_bytes"] <= 4 * 2**20 and stats["output_tokens"] == 2


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


def test_memory_utilization_sizes_the_cache_from_available_memory(monkeypatch, capsys):
    from vmemkv.runtime.memory import available_memory_bytes
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n"))
    assert main(["generate", "--memory-utilization", "0.001", "--max-new-tokens", "2", "--json",
                 "--no-progress"]) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])["stats"]
    budget = 0.001 * available_memory_bytes(__import__("torch").device("cpu"))
    assert 0.5 * budget <= stats["cache_bytes"] <= 1.1 * budget and stats["output_tokens"] == 2


@pytest.mark.parametrize("argv", [
    ["--memory-utilization", "0"], ["--memory-utilization", "1.5"], ["--memory-utilization", "nan"],
    ["--memory-utilization", "0.5", "--cache-bytes", "1MiB"]])
def test_memory_utilization_out_of_range_or_beside_cache_bytes_is_one_line(argv, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("1 2\n"))
    with pytest.raises(SystemExit) as exit_:
        main(["generate", *argv])
    assert exit_.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_8_bit_scales_are_calibrated_so_a_prompts_tokens_do_not_depend_on_its_batch(
        monkeypatch, capsys):
    """One prompt alone and beside another (batched at the first prefill) gives the same tokens
    with the default calibrated scales (with first-write scales the batch would set them:
    tests/engine/test_engine_kv_calibration.py shows them change)."""
    from argparse import Namespace

    from vmemkv.runtime.generate_cli import _kv_scales
    batch = [" ".join(map(str, p)) for p in prompts(2, 24, 24, seed=0)]
    outs = []
    for stdin in (batch[0], batch[1] + "\n" + batch[0]):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin + "\n"))
        assert main(["generate", "--kv-cache-dtype", "fp8_e5m2", "--max-new-tokens", "16",
                     "--ignore-eos", "--no-progress", "--json"]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()[:-1]]
        outs.append(records[-1]["outputs"][0]["token_ids"])
    assert outs[0] == outs[1]
    assert [_kv_scales(Namespace(kv_cache_dtype=d, kv_scales=f)) for d, f in (
        ("int8", None), ("int8", "first-write"), ("fp8_e4m3", "calibrate"), ("auto", None))] == [
        "calibrate", None, "calibrate", None]


def test_the_model_flags_help_names_every_built_in_model(capsys):
    from vmemkv.runtime.models import TINY_CONFIGS
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())       # argparse wraps at hyphens
    for name in TINY_CONFIGS:
        assert name in help_text.replace("- ", "-"), name
