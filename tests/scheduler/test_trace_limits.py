"""What a workload may hold, refused by file and line (or by the flag) before anything runs:
token counts past 10^9 in every trace format, hash ids that do not cover the prompt, and
arrival times past 1e10 s, where the simulated float clock rounds a step's milliseconds away
(epoch milliseconds given as seconds made every latency 0)."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.traces import load_trace
from vmemkv.scheduler.workload import MAX_ARRIVAL_S, TraceEntry, WorkloadSpec

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize("name, text, match", [
    # a 400-digit count was an OverflowError traceback; JSONL already stopped at 10^9
    ("digits.csv", AZURE + "2023-11-16 18:15:47.0,1" + "0" * 399 + ",5\n",
     r"digits.csv line 3: ContextTokens must be an int in \[1, 1,000,000,000\], got a "
     r"400-digit number"),
    ("big.csv", AZURE + "2023-11-16 18:15:47.0,4,2000000000\n",
     r"big.csv line 3: GeneratedTokens must be an int in \[1, 1,000,000,000\], got 2000000000"),
    ("long.csv", AZURE + "2023-11-16 18:15:47.0," + "9" * 5000 + ",5\n",
     r"long.csv line 3: ContextTokens must be an int in .*\(5,000 characters\)"),
    ("digits.jsonl", '{"prompt_len": 1' + "0" * 400 + ', "output_len": 3}\n',
     r"digits.jsonl line 1: prompt_len must be an int in .*got a 401-digit number"),
    # hash ids must cover the prompt, one per 512-token block (tokens were made up for 20
    # ids of a 10-token prompt, and the run failed later without the file or line)
    ("long_ids.jsonl", '{"prompt_len": 10, "output_len": 1, "hash_ids": [1, 2, 3]}\n',
     r"long_ids.jsonl line 1: hash_ids must list 1 ints >= 0 \(one per 512-token block of "
     r"prompt_len 10\), got \[1, 2, 3\]"),
    ("short_ids.jsonl", '{"prompt_len": 600, "output_len": 1, "hash_ids": [1]}\n',
     r"short_ids.jsonl line 1: hash_ids must list 2 ints"),
    # arrival times from the epoch
    ("epoch_ms.jsonl", '{"prompt_len": 5, "output_len": 3, "arrival_s": 0}\n'
                       '{"prompt_len": 5, "output_len": 3, "arrival_s": 1.7e12}\n',
     r"epoch_ms.jsonl line 2: arrival_s 1.7e\+12 is past 1e\+10 s \(317 years\).*since the "
     r"trace's start"),
    ("mooncake.jsonl", '{"timestamp": 1.7e15, "input_length": 6, "output_length": 2, '
                       '"hash_ids": [1]}\n',
     r"mooncake.jsonl line 1: timestamp 1.7e\+15 of ms is past 1e\+10 s"),
    # an int arrival past a float's range was an OverflowError traceback (arrival / unit)
    ("huge.jsonl", '{"prompt_len": 10, "output_len": 5, "arrival_s": 1' + "0" * 400 + '}\n',
     r"huge.jsonl line 1: arrival_s a 401-digit number is past 1e\+10 s"),
    ("huge_mooncake.jsonl", '{"timestamp": 1' + "0" * 400 + ', "input_length": 10, '
                            '"output_length": 5, "hash_ids": [0]}\n',
     r"huge_mooncake.jsonl line 1: timestamp a 401-digit number of ms is past 1e\+10 s"),
    ("years.csv", AZURE + "9999-11-16 18:15:47.0,4,2\n",
     r"years.csv \(TIMESTAMP after its first\): an arrival at 2.517e\+11 s is past 1e\+10 s"),
])
def test_a_trace_past_the_limits_is_refused_naming_the_file_and_line(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_trace(str(tmp_path / name))


def test_a_replay_rate_that_puts_arrivals_past_the_limit_is_refused():
    with pytest.raises(ConfigError, match=r"trace azure-code at rate_scale 1e-300: an arrival at "
                                          r"3.436e\+303 s is past 1e\+10 s"):
        load_trace("azure-code", rate_scale=1e-300)
    assert load_trace("azure-code", rate_scale=1e-6, max_requests=3)[-1].arrival_s < 1e10


@pytest.mark.parametrize("rate", [5e-324, 1e-200, 1.9e-9])
def test_a_poisson_rate_too_low_for_the_clock_is_refused_by_the_spec(rate):
    with pytest.raises(ConfigError, match=r"WorkloadSpec.arrival_rate .* past 1e\+10 s .* give at "
                                          r"least 2e-08"):
        WorkloadSpec(num_requests=200, arrival_rate=rate)
    WorkloadSpec(num_requests=200, arrival_rate=2e-8)


def test_the_simulator_refuses_entries_past_the_limit_and_keeps_epoch_seconds():
    entries = [TraceEntry(50, 30, 0.0), TraceEntry(60, 20, 0.5)]
    late = [TraceEntry(e.prompt_len, e.output_len, e.arrival_s + 1.7e12) for e in entries]
    with pytest.raises(ConfigError, match=r"arrival_s: an arrival at 1.7e\+12 s is past 1e\+10 s"):
        simulate(late, SimConfig(cache_bytes=10**9))
    # epoch seconds (1.7e9, below the limit): the clock still resolves microseconds there
    epoch = [TraceEntry(e.prompt_len, e.output_len, e.arrival_s + 1.7e9) for e in entries]
    at_zero, at_epoch = (simulate(w, SimConfig(cache_bytes=10**9)).serving for w in (entries, epoch))
    assert at_epoch["mean_tpot_ms"] == pytest.approx(at_zero["mean_tpot_ms"], rel=1e-4)
    assert MAX_ARRIVAL_S == 1e10
