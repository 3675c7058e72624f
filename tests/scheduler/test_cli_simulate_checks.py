"""`vmemkv simulate` refuses a mistake in one line naming the flag, exit 2, before a workload is
drawn or a simulation run: flag values that a later check refused by an internal name, flags
that do not apply together, paths that cannot be written, rates the float clock cannot hold,
custom policies that cannot be built, and more LoRA adapters than the host can draw."""
import os
from pathlib import Path

import pytest

from vmemkv.cli import main
from vmemkv.scheduler import cli, sim_memory
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.sim_memory import ADAPTER_BYTES, SimulationTooLargeError
from vmemkv.scheduler.simulator import SimConfig

BASE = ["simulate", "--requests", "20", "--cache-gb", "3", "--no-progress"]
FIND = ["--find-max-rate", "--slo", "ttft_p90=500", "--max-probes", "3"]


@pytest.fixture
def nothing_drawn(monkeypatch):
    """A check that runs after the workload is drawn fails the test instead of refusing."""
    def drawn(*args, **kwargs):
        raise AssertionError("the workload was drawn before the mistake was refused")
    monkeypatch.setattr(cli, "generate", drawn)
    monkeypatch.setattr(cli, "trace_requests", drawn)    # the run's read, not the checks'


def refused(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("vmemkv simulate: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv,words", [
    # each was accepted by its flag and refused later by an internal name, or overflowed
    (["--prompt-median", "1e300", "--prompt-p95", "1e301"], ["--prompt-median", "1000000000"]),
    (["--output-p95", "0.5"], ["--output-p95", "got 0.5"]),
    (["--paged-slowdown", "0.5"], ["--paged-slowdown", "got 0.5"]),
    (FIND + ["--search-tolerance", "1"], ["--search-tolerance", "(0, 1)", "got 1"]),
    (["--max-len", "1", "--block-size", "1"], ["--max-len", "[2, 10000000]", "got 1"]),
    # a Poisson rate whose arrivals pass the float clock's millisecond range
    (["--arrival-rate", "5e-324"], ["--arrival-rate 4.94066e-324", "1e+10 s",
                                    "--arrival-rate >= 2e-09"]),
    (["--arrival-rate", "1e-200"], ["--arrival-rate 1e-200", "317 years"]),
    # --goodput: one target per item, each metric once
    (["--goodput", "ttft:2000,tpot:200"], ["--goodput", "separated by spaces"]),
    (["--goodput", "ttft:2000", "ttft:10"], ["--goodput names ttft twice", "2000 and 10 ms"]),
    # paths --write-trace cannot write: named, before the run (a temp file's name was shown)
    (["--write-trace", "/proc/version"], ["--write-trace /proc/version", "cannot write"]),
    (["--write-trace", ""], ["--write-trace needs a file name"]),
    (["--write-trace", "/dev/null"], ["--write-trace /dev/null is not a regular file"]),
    (["--write-trace", "/"], ["--write-trace / is a folder"]),
    # flags --find-max-rate does not use
    (FIND + ["--seeds", "0-3"], ["--seeds do not apply to --find-max-rate"]),
    (FIND + ["--write-trace", "x.jsonl", "--goodput", "ttft:5"],
     ["--write-trace and --goodput do not apply to --find-max-rate"]),
    # a repeated seed is the same run twice
    (["--seeds", "2,2,2"], ["--seeds", "seed 2 given twice"]),
    (["--seeds", "0-3,3"], ["--seeds", "seed 3 given twice"]),
])
def test_a_mistake_is_one_line_naming_the_flag_before_anything_is_drawn(
        argv, words, capsys, nothing_drawn, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = refused(BASE + argv, capsys)
    for word in words:
        assert word in err, (word, err)
    assert os.listdir(tmp_path) == []           # no trace file, no temporary file left


def test_rate_scale_so_low_that_arrivals_pass_the_clock_names_the_flag(capsys):
    err = refused(["simulate", "--trace", "azure-code", "--rate-scale", "1e-300", "--no-progress"],
                  capsys)
    assert "azure-code at --rate-scale 1e-300" in err and "1e+10 s" in err


POLICIES = Path(__file__).parent / "custom_policy.py"


@pytest.mark.parametrize("policy,words", [
    ("vmemkv.scheduler.managers.paged:PagedManager",
     ["PagedManager is built as PagedManager(model, cache_bytes, max_seq_len_tokens, "
      "block_size_tokens=16, page_bytes=2097152, layout='per-layer', swap_bytes=0)",
      "unexpected keyword argument 'page_bytes'", "**options"]),
    (f"{POLICIES}:TakesNothing", ["TakesNothing is built as", "too many positional arguments"]),
    (f"{POLICIES}:Abstract", ["Abstract is abstract", "allocate", "take_ops"]),
])
def test_a_policy_class_that_cannot_be_built_is_refused_naming_the_call(
        policy, words, capsys, nothing_drawn):
    with pytest.raises(ConfigError) as error:
        SimConfig(policy=policy)
    for word in words:
        assert word in str(error.value), (word, str(error.value))
    err = refused(BASE + ["--policy", policy], capsys)
    assert words[0] in err
    # a class that takes **options is built as before
    assert SimConfig(policy=f"{POLICIES}:CoarseBlocks").make_manager().name == "coarse-blocks"


def test_lora_adapters_are_charged_before_any_is_drawn(monkeypatch, capsys, nothing_drawn):
    """--lora-adapters 1000000 held 455 MB, 4,000,000 1.7 GB, with no check; on a host with
    64 MiB available a million adapters (512 MB charged) are refused naming the flag."""
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 64 << 20)
    err = refused(BASE + ["--lora-adapters", "1000000"], capsys)
    assert "SimulationTooLargeError" in err and "1,000,000 LoRA adapters" in err
    assert f"{1_000_000 * ADAPTER_BYTES} bytes" in err and "lower --lora-adapters" in err


def test_the_adapter_charge_covers_a_measured_draw_within_twice(monkeypatch):
    import tracemalloc
    from vmemkv.scheduler.workload import LoraSpec, WorkloadSpec, assign_adapters, generate
    entries, model = generate(WorkloadSpec(num_requests=20)), SimConfig().model_spec
    assign_adapters(entries, LoraSpec(10), model)            # its imports: not measured
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        assign_adapters(entries, LoraSpec(20_000), model)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak <= 20_000 * ADAPTER_BYTES <= 2 * peak, peak
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 20_000 * ADAPTER_BYTES - 1)
    with pytest.raises(SimulationTooLargeError, match="20,000 LoRA adapters.*lower num_adapters"):
        assign_adapters(entries, LoraSpec(20_000), model)
