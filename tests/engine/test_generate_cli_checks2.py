"""``vmemkv generate``'s prompt and sampling checks, and SIGTERM (runtime/generate_io.py,
generate_checks.py, generate_cli.py): a JSONL line nested past the parser's depth is one line
naming it, exit 2; --text with --chat or a *.jsonl file, --system with a token-id line under
--chat, and --top-k / --top-p at a greedy --temperature are refused by name, not ignored; the
sampling flags and the prompts file are checked before the model loads, the errors naming the
flag; SIGTERM prints the samples that had finished, releases the cache and exits 143 with one
line, the earlier SIGTERM handler put back."""
from __future__ import annotations

import io
import signal

import pytest

from vmemkv.cli import TERMINATED_EXIT, build_parser, main
from vmemkv.runtime.generate_checks import sampling_params
from vmemkv.runtime.generate_io import GenerateUsageError, read_prompts

from ..reliability.test_cli_interrupts import _memfds, interrupt, start


def _prompts_file(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _generate(capsys, *argv) -> tuple:
    capsys.readouterr()
    code = main(["generate", "--no-progress", "--max-new-tokens", "2", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("chat", [False, True])
def test_a_jsonl_line_nested_past_the_parser_is_refused_naming_it(tmp_path, chat):
    path = _prompts_file(tmp_path, "deep.jsonl", '"fine"\n' + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(GenerateUsageError, match=r"^prompt line 2 nests too deeply"):
        read_prompts(path, True, chat=chat)


def test_a_deep_jsonl_line_is_one_line_exit_2(tmp_path, capsys):
    path = _prompts_file(tmp_path, "deep.jsonl", "[" * 2000 + "]" * 2000 + "\n")
    code, out, err = _generate(capsys, "--prompts", path)
    assert (code, out) == (2, "") and err.count("\n") == 1 and "Traceback" not in err
    assert "prompt line 1 nests too deeply" in err


@pytest.mark.parametrize("name, chat, given", [
    ("ids.jsonl", False, "(a *.jsonl file)"), ("ids.txt", True, "with --chat")])
def test_text_with_json_lines_is_refused_naming_both(tmp_path, name, chat, given):
    path = _prompts_file(tmp_path, name, "[1, 2, 3]\n")
    with pytest.raises(GenerateUsageError, match=r"^--text reads the lines of a plain-text") as info:
        read_prompts(path, True, text_only=True, chat=chat)
    assert given in str(info.value)
    assert read_prompts(path, True, chat=chat) == [[1, 2, 3]]    # without --text: token ids


def test_system_refuses_a_token_id_line_under_chat(tmp_path):
    path = _prompts_file(tmp_path, "c.jsonl", '"hi"\n\n[1, 2, 3]\n')
    with pytest.raises(GenerateUsageError, match=r"^prompt line 3 is token ids, sent as they are "
                                                 r"without the chat template, so --system"):
        read_prompts(path, True, chat=True, system="Be brief.")
    assert read_prompts(path, True, chat=True)[1] == [1, 2, 3]    # no --system: sent as is


def _sampling(*argv):
    return sampling_params(build_parser().parse_args(["generate", *argv]))


@pytest.mark.parametrize("argv, flag", [(["--top-k", "5"], "--top-k 5"),
                                        (["--top-p", "0.5"], "--top-p 0.5"),
                                        (["--top-k", "5", "--temperature", "1e-6"], "--top-k 5")])
def test_sampling_only_flags_are_refused_when_decoding_is_greedy(argv, flag):
    with pytest.raises(GenerateUsageError, match=f"^{flag} applies when sampling, and "
                                                 f"--temperature .* decodes greedily"):
        _sampling(*argv)


def test_sampling_only_flags_apply_with_a_temperature():
    params = _sampling("--top-k", "5", "--top-p", "0.5", "--temperature", "0.7", "--n", "3")
    assert (params.top_k, params.top_p, params.temperature, params.n) == (5, 0.5, 0.7, 3)
    assert _sampling().greedy and _sampling().top_k == 0


@pytest.mark.parametrize("argv, start", [
    (["--temperature", "1e39"], "--temperature must be a finite number >= 0"),
    (["--stop", ""], "--stop must be at most 16 non-empty strings"),
    (["--prompts", "/nonexistent/p.txt"], "cannot read prompts from '/nonexistent/p.txt'"),
    (["--text", "--prompts", "/nonexistent/p.jsonl"], "--text reads the lines of a plain-text"),
])
def test_sampling_flags_and_the_prompts_file_are_checked_before_the_model_loads(argv, start,
                                                                              tmp_path, capsys):
    """A --model that cannot load would be refused first if these were checked after it."""
    code, out, err = _generate(capsys, "--model", str(tmp_path / "no-such-model"), *argv)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"vmemkv generate: error: GenerateUsageError: {start}"), err


def test_sigterm_prints_what_finished_releases_the_cache_and_restores_the_handler(monkeypatch,
                                                                                capsys):
    """In process: the hold point calls the SIGTERM handler generate installed, as the signal
    would; the cache's page pool (a memfd) is open then and closed after."""
    def sigterm(name, timeout_s=0.0):
        assert _memfds() > baseline
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    def before(signum, frame):
        raise AssertionError("the earlier handler ran")
    previous = signal.signal(signal.SIGTERM, before)
    try:
        baseline = _memfds()
        monkeypatch.setattr("sys.stdin", io.StringIO("1 2 3\n4 5 6 7\n"))
        monkeypatch.setattr("vmemkv.runtime.generate_cli.hold_point", sigterm)
        code, out, err = _generate(capsys)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == TERMINATED_EXIT == 143 and _memfds() == baseline
    assert err == ("vmemkv generate: terminated (SIGTERM); printed the 1 of 2 samples that had "
                   "finished; the cache is released\n")
    (line,) = out.splitlines()
    assert line.startswith("[prompt 0 sample 0] ") and len(line.split("] ")[1].split()) == 2


def test_sigterm_to_a_running_generate_exits_143_with_the_finished_samples(tmp_path):
    """A real SIGTERM, sent once the subprocess says it holds after its first sample ended."""
    proc = start("generate", ["generate", "--max-new-tokens", "3", "--no-progress"], tmp_path,
                 stdin="1 2 3\n4 5 6 7\n")
    rc, out, err = interrupt(proc, signal.SIGTERM)
    assert rc == 143, err
    assert err == ("vmemkv generate: terminated (SIGTERM); printed the 1 of 2 samples that had "
                   "finished; the cache is released\n")
    (line,) = out.splitlines()
    assert line.startswith("[prompt ") and len(line.split("] ")[1].split()) == 3
