"""`vmemkv sweep` refuses, when it reads a spec, what `vmemkv simulate` refuses in its flags:
workload keys that apply to no point (they ran one simulation under several labels), a
deployment no machine can run (a cache larger than the GPU, swap preemption without swap
space), a value outside its choices; and a reader that closes stdout early ends the listing
quietly."""
import os
import subprocess
import sys

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.sweep import expand, load_spec
from vmemkv.scheduler.workload import TraceEntry, write_trace


def spec_file(tmp_path, text: str) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, words", [
    # the audit's s2.toml: six labels, one simulation
    ('[base]\nrequests = 60\ncache_gb = 3\n[grid]\nrate_scale = [1, 4, 16]\n'
     'max_requests = [10, 20]\n',
     ["grid.rate_scale, grid.max_requests apply to a trace, and no point replays one",
      "arrival_rate and requests"]),
    ('[base]\nmax_requests = 10\n', ["base.max_requests apply to a trace"]),
    # the audit's s3.toml: eight labels, one simulation
    ('[base]\ntrace = "azure-code"\nmax_requests = 50\ncache_gb = 3\n[grid]\n'
     'arrival_rate = [1, 100]\nrequests = [10, 1000]\nseed = [0, 1]\n',
     ["grid.requests, grid.arrival_rate, grid.seed apply to a generated workload",
      "every point replays a trace (azure-code)", "rate_scale and max_requests"]),
    ('[base]\nworkload_rng = "python"\n[grid]\ntrace = ["azure-code", "azure-conv"]\n',
     ["base.workload_rng apply to a generated workload"]),
    # checked when read (was a failed row after the run started)
    ('[grid]\nworkload_rng = ["torch"]\n',
     ["grid.workload_rng[0] must be one of numpy, python, got 'torch'"]),
    ('[grid]\npreemption = ["drop"]\n', ["grid.preemption[0] must be one of"]),
    ('[base]\npaged_slowdown = 0.5\n', ["base.paged_slowdown must be a finite number >= 1"]),
])
def test_a_spec_key_that_applies_to_no_point_is_refused_when_read(tmp_path, text, words):
    with pytest.raises(ConfigError) as error:
        load_spec(spec_file(tmp_path, text))
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_a_grid_of_traces_and_generated_workloads_keeps_each_key_where_it_applies(tmp_path):
    trace = str(tmp_path / "t.jsonl")
    write_trace(trace, [TraceEntry(5, 3, 0.0)])
    generated = expand({"base": {}, "grid": {"trace": [trace, None], "requests": [10, 20],
                                             "rate_scale": [1, 2]}})
    # the trace at 2 scales, the generated workload at 2 sizes: 4 simulations, not 8
    assert sorted((p["trace"] is None, p["requests"], p["rate_scale"]) for p in generated) == [
        (False, 2000, 1), (False, 2000, 2), (True, 10, 1), (True, 20, 1)]


@pytest.mark.parametrize("grid, words", [
    ('cache_gb = [3, 1000]', ["point cache_gb = 1000", "cache_gb 1000 plus llama-3-8b's 16.1 GB",
                              "h100's 85.9 GB", "at most cache_gb 69.8 fits"]),
    ('preemption = ["recompute", "swap"]', ["point preemption = 'swap'",
                                            "preemption swap needs host swap space",
                                            "swap_gb > 0"]),
    ('block_size = [16, 8192]', ["point block_size = 8192",
                                 "block_size 8192 tokens is longer than max_len 4096"]),
])
def test_a_point_no_machine_can_run_is_refused_before_any_runs(tmp_path, grid, words):
    with pytest.raises(ConfigError) as error:
        expand(load_spec(spec_file(tmp_path, f"[base]\nrequests = 10\n[grid]\n{grid}\n")))
    for word in words:
        assert word in str(error.value), (word, str(error.value))
    assert expand(load_spec(spec_file(tmp_path, "[grid]\nswap_gb = [1]\npreemption = ['swap']\n")))


def test_a_reader_that_closes_stdout_ends_the_listing_quietly(tmp_path):
    """`vmemkv sweep spec | head -1` printed "error: BrokenPipeError" and exit 2 after writing
    every file; the pipe is closed before the sweep writes a line."""
    spec = spec_file(tmp_path, "[base]\nrequests = 10\ncache_gb = 2\n[grid]\npolicy = ['paged']\n")
    out = tmp_path / "out"
    read, write = os.pipe()
    os.close(read)                                # the reader has gone
    code = ("import sys; from vmemkv.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "sweep", spec, "--out", str(out),
                           "--jobs", "1", "--no-progress", "--no-plots"],
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert (out / "sweep.csv").exists()


def test_a_pool_past_host_memory_is_named_as_the_pool_not_as_zero_requests(tmp_path, monkeypatch):
    from vmemkv.scheduler import sim_memory
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 2**30)   # the host faked: 1 GiB
    spec = '[base]\nrequests = 4\npolicy = "vmem"\npage_bytes = "2048"\n'   # llama's 1 token
    with pytest.raises(ConfigError) as error:
        expand(load_spec(spec_file(tmp_path, spec)))
    text = str(error.value)
    assert "a pool of 29,296,875 pages or blocks (the manager's tables, before any request " \
           "is drawn) needs about 4695888608 bytes" in text, text     # 160 bytes a page
    assert "0 requests" not in text and "give larger pages or blocks, or a smaller cache_gb" in text
