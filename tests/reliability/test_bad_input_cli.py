"""Bad input to ``vmemkv generate`` and ``vmemkv bench`` (docs/errors.md, CLI tables): exit
status 2, exactly one line on stderr, no traceback."""

import pytest
import torch

from vmemkv.cli import main


# ---- CLI: generate and bench -------------------------------------------------------------
def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    except Exception as error:     # an uncaught error is what a user sees as a traceback
        code = f"uncaught {type(error).__name__}: {error}"
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def prompt_files(tmp_path):
    files = {"good": "1 2 3\n", "text": "1 2 3\nhello world\n", "blank": "\n  \n",
             "vocab": "1 300\n", "long": " ".join(["1"] * 20) + "\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_text(text)
    return tmp_path


GENERATE_CLI_CASES = [
    ("unknown-model", ["--model", "gpt-9", "--prompts", "{good}"], ["ModelLoadError", "'gpt-9'", "tiny-llama"]),
    ("missing-prompts", ["--prompts", "{dir}/missing.txt"], ["cannot read prompts", "missing.txt",
                                                              "No such file"]),
    ("text-line-without-tokenizer", ["--prompts", "{text}"], ["prompt line 2", "no tokenizer", "'hello world'"]),
    ("no-prompts", ["--prompts", "{blank}"], ["no prompts in", "blank.txt"]),
    ("token-outside-vocab", ["--prompts", "{vocab}"], ["RequestRejectedError: prompt line 1 has", "[300]", "[0, 256)"]),
    ("prompt-too-long", ["--prompts", "{long}", "--cache", "paged", "--max-context", "16"],
     ["RequestRejectedError: prompt line 1 rejected", "20 prompt + 16 new tokens", "16 tokens"]),
    ("max-new-tokens", ["--prompts", "{good}", "--max-new-tokens", "0"], ["argument --max-new-tokens: must be >= 1, got 0"]),
    ("max-new-tokens-not-int", ["--prompts", "{good}", "--max-new-tokens", "abc"],
     ["argument --max-new-tokens: want an integer, got 'abc'"]),
    ("temperature", ["--prompts", "{good}", "--temperature", "-1"], ["--temperature", ">= 0", "-1"]),
    ("temperature-inf", ["--prompts", "{good}", "--temperature", "inf"], ["--temperature", "finite", "'inf'"]),
    ("temperature-nan", ["--prompts", "{good}", "--temperature", "nan"], ["--temperature", "finite", "'nan'"]),
    ("stop-negative", ["--prompts", "{good}", "--stop-token-id", "-1"], ["--stop-token-id", ">= 0", "got -1"]),
    ("threads-too-many", ["--prompts", "{good}", "--threads", "100000"],
     ["--threads", "got 100000", "CPUs"]),
    ("block-size-above-context", ["--prompts", "{good}", "--cache", "paged", "--block-size", "100000"],
     ["--block-size 100000", "--max-context 1024"]),
    ("page-bytes-bad-size", ["--prompts", "{good}", "--page-bytes", "64XB"], ["--page-bytes", "bad size '64XB'"]),
    ("top-k", ["--prompts", "{good}", "--top-k", "-1"], ["argument --top-k: must be >= 0, got -1"]),
    ("top-p", ["--prompts", "{good}", "--top-p", "0"], ["argument --top-p: must be in (0, 1], got 0"]),
    ("n", ["--prompts", "{good}", "--n", "0"], ["argument --n: must be >= 1, got 0"]),
    ("seed-past-int64", ["--prompts", "{good}", "--seed", "100000000000000000000000"],
     ["argument --seed: must be in [0, 9223372036854775807]"]),
    ("max-batch", ["--prompts", "{good}", "--max-batch", "0"], ["argument --max-batch: must be >= 1, got 0"]),
    ("max-context", ["--prompts", "{good}", "--max-context", "1"], ["EngineConfig.max_context", ">= 2", "1"]),
    ("block-size", ["--prompts", "{good}", "--cache", "paged", "--block-size", "0"],
     ["argument --block-size: must be >= 1, got 0"]),
    ("swap-without-space", ["--prompts", "{good}", "--preemption", "swap"],
     ["--preemption swap", "--swap-bytes", "> 0"]),
    ("watermark", ["--prompts", "{good}", "--watermark", "1"], ["--watermark", "[0, 1)", "got 1"]),
    ("page-bytes", ["--prompts", "{good}", "--page-bytes", "3"], ["ConfigError", "page_bytes=3", ">= 128"]),
    ("cache-bytes", ["--prompts", "{good}", "--cache-bytes", "100"], ["ConfigError", "cache_bytes=100"]),
    ("attention", ["--prompts", "{good}", "--attention", "flash9"], ["'flash9'", "sdpa"]),
    pytest.param("attention-unavailable-here", ["--prompts", "{good}", "--attention", "flash"],
                 ["BackendUnavailableError", "'flash'", "CUDA is not available"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
    ("attention-package-missing", ["--prompts", "{good}", "--attention", "flash-attn"],
     ["BackendUnavailableError", "'flash-attn'"]),
    ("cache-choice", ["--prompts", "{good}", "--cache", "flat"], ["--cache", "invalid choice: 'flat'"]),
    ("dtype-choice", ["--prompts", "{good}", "--dtype", "int8"], ["--dtype", "invalid choice: 'int8'"]),
    ("device-unknown", ["--prompts", "{good}", "--device", "tpu"], ["--device", "'tpu'"]),
    ("kv-scales-16-bit", ["--prompts", "{good}", "--kv-scales", "first-write"],
     ["--kv-scales", "8-bit", "not auto"]),
    pytest.param("device-cuda-without-gpu", ["--prompts", "{good}", "--device", "cuda"], ["cuda"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
]

BENCH_CLI_CASES = [
    ("only-unknown-section", ["--only", "bogus"], ["--only", "invalid choice: 'bogus'", "alloc"]),
    ("only-nothing", ["--only"], ["--only", "expected at least one argument"]),
    ("threads-zero", ["--threads", "0"], ["--threads", "must be in [1, ", "got 0"]),
    ("threads-negative", ["--threads", "-2"], ["--threads", "must be in [1, ", "got -2"]),
    ("threads-too-many", ["--threads", "100000"], ["--threads", "got 100000", "CPUs"]),
    ("threads-not-int", ["--threads", "x"], ["--threads", "want an integer, got 'x'"]),
    ("device-choice", ["--device", "tpu"], ["--device", "invalid choice: 'tpu'"]),
    # before any section runs (the suite ran, then failed: FileNotFoundError / exit 1)
    ("out-empty", ["--out", ""], ["--out needs a folder name, got ''"]),
    ("tp-not-dividing-heads", ["--tp", "3"],
     ["--tp 3: the tensor-parallel section's model (small-llama) cannot run 3 ranks",
      "does not divide the model's 8 attention heads"]),
    ("tp-past-heads", ["--tp", "1000"], ["--tp 1000", "exceeds the model's 8 attention heads"]),
]


def _cli_params(command, cases):
    out = []
    for case in cases:
        if hasattr(case, "marks"):
            out.append(pytest.param(command, *case.values[1:], id=case.values[0], marks=case.marks))
        else:
            out.append(pytest.param(command, *case[1:], id=case[0]))
    return out


@pytest.mark.parametrize("command,argv,words", _cli_params("generate", GENERATE_CLI_CASES)
                         + _cli_params("bench", BENCH_CLI_CASES))
def test_cli_error_is_one_line_exit_2(command, argv, words, prompt_files, capsys):
    paths = {name: str(prompt_files / f"{name}.txt") for name in ("good", "text", "blank", "vocab", "long")}
    argv = [command] + [a.format(dir=prompt_files, **paths) for a in argv]
    if command == "generate":
        argv.append("--no-progress")
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith(f"vmemkv {command}: error: "), err
    assert "Traceback" not in err and out == ""
    for word in words:
        assert word in err, (word, err)


def test_bench_cuda_without_a_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    code, out, err = run_cli(["bench", "--device", "cuda"], capsys)
    assert code == 2 and out == ""
    assert err == "vmemkv bench: error: --device cuda but torch sees no CUDA GPU\n"
