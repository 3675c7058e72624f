"""`vmemkv generate`'s flags, as a user types them: a value that cannot work is refused as one
line naming the flag the user gave (exit 2), never a config field they never typed, and never
accepted to do nothing (docs/usage.md "The command line")."""
import pytest

from vmemkv import cli
from vmemkv.runtime import generate_cli


def generate(argv, tmp_path, capsys):
    """(exit status, stdout, stderr) of ``vmemkv generate ARGV`` on one token-id prompt (only
    generate's parser is built: the test depends on no other subcommand)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n")
    parser = cli.OneLineArgumentParser(prog="vmemkv")
    generate_cli.register(parser.add_subparsers(dest="command", required=True,
                                                parser_class=cli.OneLineArgumentParser))
    args = parser.parse_args(["generate", "--prompts", str(prompts), "--no-progress",
                              "--max-new-tokens", "2"] + argv)
    code = cli.command_status("vmemkv generate", lambda: generate_cli.run(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_memory_utilization_too_small_for_a_page_is_refused_naming_the_flag(cache, tmp_path,
                                                                            capsys):
    code, out, err = generate(["--memory-utilization", "1e-9", "--cache", cache], tmp_path, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("vmemkv generate: error: GenerateUsageError: --memory-utilization 1e-09 "
                          "gives the KV cache "), err
    assert "cache_bytes=" not in err, err      # the old line blamed a field nobody gave


def test_memory_utilization_below_a_byte_is_refused_naming_the_flag(tmp_path, capsys):
    code, _, err = generate(["--memory-utilization", "1e-15"], tmp_path, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "error: GenerateUsageError: --memory-utilization 1e-15 of the " in err, err
    assert err.rstrip().endswith("give a larger fraction or --cache-bytes"), err


def test_cache_bytes_too_small_still_names_cache_bytes(tmp_path, capsys):
    code, _, err = generate(["--cache-bytes", "1"], tmp_path, capsys)
    assert code == 2 and "cache_bytes=1 holds no page group" in err, err


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_swap_space_that_holds_no_token_is_refused(cache, tmp_path, capsys):
    # tiny-llama (fp32): 512 bytes of K/V a token, all layers
    code, out, err = generate(["--preemption", "swap", "--swap-bytes", "511", "--cache", cache],
                              tmp_path, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "error: GenerateUsageError: --swap-bytes 511 holds no token: one token's K/V of " \
           "every layer is 512 bytes here" in err, err


def test_swap_space_of_one_token_is_taken(tmp_path, capsys):
    code, out, err = generate(["--preemption", "swap", "--swap-bytes", "512"], tmp_path, capsys)
    assert code == 0, err
    assert len(out.split()) == 2       # the prompt's two new tokens


def bench_status(argv, tmp_path, capsys):
    """(exit status, stderr) of ``vmemkv bench ARGV`` (only bench's parser is built)."""
    from vmemkv import bench
    parser = cli.OneLineArgumentParser(prog="vmemkv")
    bench.register(parser.add_subparsers(dest="command", required=True,
                                         parser_class=cli.OneLineArgumentParser))
    args = parser.parse_args(["bench", "--out", str(tmp_path / "out")] + argv)
    code = cli.command_status("vmemkv bench", lambda: bench.run(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("device", [[], ["--device", "cuda"]], ids=["default", "cuda"])
def test_bench_refuses_8bit_kv_on_the_gpu_before_any_section_runs(device, tmp_path, capsys,
                                                                  monkeypatch):
    import torch
    from vmemkv.benchmarks import suite
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a GPU machine

    def no_suite(**_):
        raise AssertionError("the suite ran: its engine section could only fail on the GPU")
    monkeypatch.setattr(suite, "run_suite", no_suite)
    code, err = bench_status(["--smoke", "--no-plots", "--kv-cache-dtype", "int8"] + device,
                             tmp_path, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("vmemkv bench: error: --kv-cache-dtype int8 runs on the CPU only"), err


def test_bench_takes_8bit_kv_on_the_cpu(tmp_path, capsys, monkeypatch):
    from vmemkv.benchmarks import suite
    ran = {}

    def recorded(**kwargs):
        ran.update(kwargs)
        raise KeyboardInterrupt("stopped by the test")
    monkeypatch.setattr(suite, "run_suite", recorded)
    code, err = bench_status(["--smoke", "--no-plots", "--device", "cpu", "--only", "engine",
                              "--kv-cache-dtype", "int8"], tmp_path, capsys)
    assert code == 130, err
    assert ran["device"] == "cpu" and ran["options"]["engine"] == {"kv_cache_dtype": "int8"}


def test_max_cache_bytes_above_the_device_total_is_refused_before_the_engine(tmp_path, capsys,
                                                                             monkeypatch):
    from vmemkv.runtime import memory
    total_bytes = 64 * 2**20          # a 64 MiB host: the 4 MiB cache fits, a 128 MiB ceiling not
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: total_bytes)
    code, out, err = generate(["--max-cache-bytes", "128MiB"], tmp_path, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "error: CacheTooLargeError: --max-cache-bytes 134217728 needs 134217728 bytes" in err
    assert f"is {total_bytes} bytes" in err, err


def test_max_cache_bytes_within_the_device_total_is_taken(tmp_path, capsys):
    code, out, err = generate(["--max-cache-bytes", "8MiB"], tmp_path, capsys)
    assert code == 0 and len(out.split()) == 2, err


def _request(request_id, *texts):
    from types import SimpleNamespace
    return SimpleNamespace(request_id=request_id, outputs=[
        SimpleNamespace(index=i, text=t, token_ids=[1]) for i, t in enumerate(texts)])


@pytest.mark.parametrize("text", ["a\rb", "a\rb\nc", "a\r\nb"])
def test_a_sample_with_a_carriage_return_is_labelled_and_its_lines_indented(text):
    import io
    from vmemkv.runtime.generate_io import INDENT, format_output, needs_labels
    outputs = [_request(0, text), _request(1, "c")]
    labelled = needs_labels(outputs, n=1, chat=False)
    printed = "".join(format_output(out, False, labelled) for out in outputs)
    # read back as Python reads a text file (universal newlines: "\r" ends a line too)
    lines = io.StringIO(printed, newline=None).read().split("\n")[:-1]
    assert labelled
    assert [line.startswith("[prompt ") for line in lines].count(True) == 2, lines
    assert all(line.startswith(("[prompt ", INDENT)) for line in lines), lines


def test_system_flag_adds_no_second_system_message_to_a_conversation_that_has_one():
    from vmemkv.runtime.generate_io import parse_prompt_lines
    later = [{"role": "user", "content": "hi"}, {"role": "system", "content": "mine"},
             {"role": "user", "content": "again"}]
    lines = [(1, '[{"role": "user", "content": "hi"}, {"role": "system", "content": "mine"}, '
                 '{"role": "user", "content": "again"}]'), (2, "plain")]
    prompts = parse_prompt_lines(lines, "chats.jsonl", True, chat=True, system="Be brief.")
    assert prompts == [(1, later), (2, [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "plain"}])]


def test_a_prompt_too_long_for_max_context_names_the_flag_not_max_seq_len(tmp_path, capsys):
    code, out, err = generate(["--max-context", "4"], tmp_path, capsys)   # 3 + 2 tokens > 4
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.rstrip().endswith("prompt line 1 rejected: 3 prompt + 2 new tokens = 5 tokens "
                                 "exceed the 4 tokens one sequence may hold (--max-context 4)"), err


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_8bit_kv_on_a_gpu_is_refused_by_the_flags_before_the_model_loads(device):
    from vmemkv.runtime.generate_checks import check_flags
    from vmemkv.runtime.generate_io import GenerateUsageError
    parser = cli.OneLineArgumentParser(prog="vmemkv")
    generate_cli.register(parser.add_subparsers(dest="command", required=True,
                                                parser_class=cli.OneLineArgumentParser))
    args = parser.parse_args(["generate", "--device", device, "--kv-cache-dtype", "fp8_e4m3"])
    with pytest.raises(GenerateUsageError, match=f"^--kv-cache-dtype fp8_e4m3 runs on the CPU "
                                                 f"only .* and --device is {device}: "):
        check_flags(args)      # (a CPU machine refuses --device cuda first: check_device)


def test_ctrl_c_while_the_subcommands_load_is_one_line_and_status_130(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt     # Ctrl-C in the first second: the modules were importing
    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["generate"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C went up out of main: a traceback, not one line")
    assert code == cli.INTERRUPTED_EXIT
    assert capsys.readouterr().err == "vmemkv: interrupted\n"


@pytest.mark.parametrize("argv,named,remedy", [
    (["--max-batch", "256"],          # 256 slots x 1024 tokens x 512 bytes = 128 MiB by default
     "(256 slots of 1024 tokens; no --cache-bytes: --max-batch slots of --max-context tokens)",
     "lower --max-batch or --max-context, or give --cache-bytes or --memory-utilization"),
    (["--cache-bytes", "128MiB"], "(--cache-bytes 134217728)",
     "lower --cache-bytes (or use --memory-utilization)"),
    (["--preemption", "swap", "--swap-bytes", "128MiB"], "(--swap-bytes 134217728)",
     "lower --swap-bytes"),
], ids=["default budget", "cache-bytes", "swap-bytes"])
def test_a_budget_too_large_for_the_device_names_the_flags(argv, named, remedy, tmp_path, capsys,
                                                           monkeypatch):
    from vmemkv.runtime import memory
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 64 * 2**20)   # 64 MiB host
    code, out, err = generate(argv, tmp_path, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "error: CacheTooLargeError: " in err and named in err, err
    assert err.rstrip().endswith(remedy), err
    assert "cache_bytes" not in err and "swap_bytes" not in err, err
