"""What a Python caller hands the trace and workload functions: a path as a pathlib.Path or
an int, hash ids that do not match the prompt, a lane shifted past the clock's limit, ranks
given as one int. Each was an untyped exception, a closed descriptor or a silently wrong
value; each is now taken (a Path) or a ConfigError naming it."""
import json
import os
import pathlib
import stat

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.presets import get_model
from vmemkv.scheduler.shared_workloads import shifted_traces
from vmemkv.scheduler.sim_config import SimConfig
from vmemkv.scheduler.simulator import simulate
from vmemkv.scheduler.traces import load_trace, prompt_token_ids
from vmemkv.scheduler.workload import (LoraSpec, TraceEntry, WorkloadSpec, generate,
                                       make_adapters, write_trace)


def write_lines(path: pathlib.Path, *arrivals_s: float) -> pathlib.Path:
    path.write_text("".join(json.dumps({"prompt_len": 600, "output_len": 5, "arrival_s": a,
                                        "hash_ids": [1, 2]}) + "\n" for a in arrivals_s))
    return path


# --- a trace's path ---------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_pathlib_path_is_written_and_read_as_its_name_is(tmp_path, suffix):
    # both raised AttributeError: 'PosixPath' object has no attribute 'endswith'
    path = tmp_path / f"t{suffix}"
    entries = [TraceEntry(600, 5, 0.0, (1, 2)), TraceEntry(10, 3, 0.5)]
    write_trace(path, entries)
    assert load_trace(path) == load_trace(str(path)) == entries
    assert shifted_traces({"a": path, "b": path}, 1.0)["b"][1].arrival_s == 1.5


def test_a_csv_path_object_is_refused_for_writing_as_a_csv_name_is(tmp_path):
    with pytest.raises(ConfigError, match=r"a \.csv trace is read as Azure's columns"):
        write_trace(tmp_path / "t.csv", [TraceEntry(1, 1, 0.0)])
    assert not (tmp_path / "t.csv").exists()


def test_an_int_is_refused_and_the_callers_descriptor_left_open(tmp_path):
    # open(fd) read the caller's descriptor, closed it, then raised AttributeError
    fd = os.open(write_lines(tmp_path / "t.jsonl", 0.0), os.O_RDONLY)
    try:
        with pytest.raises(ConfigError, match=r"^load_trace: a trace is a bundled trace's "
                                              r"name or a file name \(str or os\.PathLike\), "
                                              rf"got int {fd}$"):
            load_trace(fd)
        os.fstat(fd)                     # still open: OSError (EBADF) if it was closed
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", [b"t.jsonl", None, 3.5])
def test_what_is_no_file_name_is_refused_by_write_trace_and_nothing_written(tmp_path, path):
    with pytest.raises(ConfigError, match=r"^write_trace: a trace is .* got "):
        write_trace(path, [TraceEntry(1, 1, 0.0)])
    with pytest.raises(ConfigError, match=r"^load_trace: a trace is .* got "):
        load_trace(path)


# --- hash ids are one per 512-token block of the prompt ---------------------------------------

@pytest.mark.parametrize("prompt_len, hash_ids", [
    (1000, (1,)),          # prompt_token_ids gave 512 tokens for a 1,000-token prompt
    (600, (1, 2, 3)),      # 688 tokens for 600 (the third block's [:-424])
    (10, (1, 2)),
    (600, (1, -2)),
    (600, (1, True)),
    (600, (1, 2.0)),
])
def test_an_entry_whose_hash_ids_do_not_fit_its_prompt_is_refused_by_name(prompt_len,
                                                                          hash_ids):
    with pytest.raises(ConfigError, match=r"^TraceEntry\.hash_ids must list "
                                          rf"{-(-prompt_len // 512)} ints >= 0 \(one per "
                                          rf"512-token block of prompt_len {prompt_len}\)"):
        TraceEntry(prompt_len, 5, 0.0, hash_ids)


@pytest.mark.parametrize("hash_ids", [None, 7, "ab", {1: 2}])
def test_hash_ids_that_are_not_a_list_of_ids_are_refused(hash_ids):
    with pytest.raises(ConfigError, match=r"^TraceEntry\.hash_ids must list 1 ints >= 0"):
        TraceEntry(10, 5, 0.0, hash_ids)


def test_a_list_of_hash_ids_is_kept_as_a_tuple_and_simulates():
    # a list was kept: the simulator's memo key (hash_ids, prompt_len) raised TypeError
    entry = TraceEntry(600, 5, 0.0, [7, 8])
    assert entry.hash_ids == (7, 8) and entry == TraceEntry(600, 5, 0.0, (7, 8))
    assert len(prompt_token_ids(entry, 1000)) == 600
    result = simulate([entry, TraceEntry(600, 5, 0.5, [7, 8])],
                      SimConfig(policy="paged", cache_bytes=2 * 10**9, copy_bytes_per_s=1e10))
    assert result.num_requests == 2


# --- shifted traces stay within the clock's limit ---------------------------------------------

def test_a_lane_shifted_past_the_clock_limit_is_refused_naming_it(tmp_path):
    path = write_lines(tmp_path / "late.jsonl", 0.0, 9.5e9)
    assert shifted_traces({"a": str(path), "b": str(path)}, 4e8)["b"][1].arrival_s == 9.9e9
    with pytest.raises(ConfigError, match=r"^shifted_traces: lane 'b' \(.*late\.jsonl shifted "
                                          r"1e\+09 s\): an arrival at 1.05e\+10 s is past "
                                          r"1e\+10 s \(entry 1; 317 years\)"):
        shifted_traces({"a": str(path), "b": str(path)}, 1e9)


def test_traces_not_given_as_a_mapping_are_refused():
    with pytest.raises(ConfigError, match=r"^shifted_traces: traces must map each model's "
                                          r"name to its trace, got list"):
        shifted_traces(["azure-code"], 1.0)


# --- LoRA ranks -------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [8, "8", None])
def test_ranks_given_as_one_value_are_refused_by_name(ranks):
    # 8 raised TypeError: 'int' object is not iterable
    with pytest.raises(ConfigError, match=r"^LoraSpec\.ranks must be a list or tuple of ints "
                                          r">= 1, got "):
        LoraSpec(2, ranks=ranks)
    assert [a.num_bytes for a in make_adapters(LoraSpec(2, ranks=[8]), get_model("llama-3-8b"))
            ] == [8 * 1703936] * 2


# --- the python draw keeps lengths within a trace's limit, as the numpy draw does -------------

def test_the_python_draw_clips_lengths_to_the_token_limit_as_the_numpy_draw_does():
    # a 1,014,634,897-token prompt was refused mid-draw: "TraceEntry.prompt_len must be an int
    # in [1, 1,000,000,000]", where the numpy draw clipped it
    spec = WorkloadSpec(num_requests=20, prompt_median=5e8, prompt_p95=1e9, max_total_len=10**10,
                        rng="python")
    prompts = [e.prompt_len for e in generate(spec)]
    assert max(prompts) == 10**9 and min(prompts) >= 1
    assert prompts == [e.prompt_len for e in generate(spec)]


# --- write_trace writes a file, never over a pipe or a device ---------------------------------

def test_write_trace_refuses_a_pipe_and_leaves_it_a_pipe(tmp_path):
    # os.replace put a regular file where the pipe was (as root, /dev/null became a file)
    pipe = tmp_path / "p.jsonl"
    os.mkfifo(pipe)
    with pytest.raises(ConfigError, match=rf"^write_trace {pipe} is not a regular file \(a "
                                          r"device or a pipe would be replaced\)"):
        write_trace(str(pipe), [TraceEntry(1, 1, 0.0)])
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)


@pytest.mark.parametrize("name, why", [("", r"needs a file name, got ''"),
                                       (".", r"\. is a folder: give a file name")])
def test_write_trace_refuses_what_is_no_file_name(tmp_path, monkeypatch, name, why):
    # both were an IsADirectoryError naming a temporary file
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^write_trace {why}"):
        write_trace(name, [TraceEntry(1, 1, 0.0)])
    assert os.listdir(tmp_path) == []


# --- a bool is not a number of tokens or an exponent -------------------------------------------

@pytest.mark.parametrize("field", ["prompt_median", "output_mean"])
def test_a_bool_length_is_refused_by_the_workload_spec(field):
    # prompt_median=True drew a workload of median 1 token
    with pytest.raises(ConfigError, match=rf"^WorkloadSpec\.{field} must be a number of tokens "
                                          r"in \[1, 1,000,000,000\], got True$"):
        WorkloadSpec(**{field: True})


def test_a_bool_zipf_alpha_is_refused():
    with pytest.raises(ConfigError, match=r"^LoraSpec\.zipf_alpha must be a finite number >= 0, "
                                          r"got True$"):
        LoraSpec(2, zipf_alpha=True)
