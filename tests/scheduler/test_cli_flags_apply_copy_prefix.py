"""`vmemkv simulate --copy-gbps` and `--prefix-eviction` are refused by name (one line, exit 2,
nothing drawn or written) where they provably change nothing: a generated workload shares no
prompt prefix (no hash ids, so prefix sharing stays off: nothing is kept for eviction and no hit
copied), and copies come only from copy-on-write after a --n or --beam-width fork, never from a
reserve policy. Both were accepted there and the result was byte-identical to the run without
them. Where they do act (a fork, a trace with hash ids) they are accepted, and change the run."""
import json

import pytest

from vmemkv.cli import main
from vmemkv.scheduler import cli
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

SIM = ["simulate", "--requests", "30", "--cache-gb", "1", "--no-progress", "--json"]
TRACE = ["simulate", "--trace", "mooncake-conversation", "--max-requests", "20", "--cache-gb",
         "2", "--policy", "vmem", "--no-progress", "--json"]

# (extra flags, what the one line says: the flag with its value, then why)
REFUSED = [
    (["--copy-gbps", "1"], ["--copy-gbps 1 applies to copy-on-write after --n > 1 or "
                            "--beam-width > 0 forks", "with a generated workload, --n 1 and "
                            "--beam-width 0 (nothing is copied) it would do nothing: drop it"]),
    (["--policy", "vmem", "--copy-gbps", "100"], ["--copy-gbps 100 applies to copy-on-write"]),
    (["--policy", "reserve-max", "--n", "2", "--copy-gbps", "1"],
     ["--copy-gbps 1 applies to --policy paged, vmem and module:Class (their copy ops)",
      "with --policy reserve-max it would do nothing"]),
    (["--prefix-eviction", "hits"], ["--prefix-eviction hits applies to a --trace whose requests "
                                     "name their prompt blocks", "with a generated workload"]),
    (["--n", "3", "--prefix-eviction", "off"], ["--prefix-eviction off applies to a --trace"]),
    (["--policy", "vmem", "--beam-width", "2", "--prefix-eviction", "lru"],
     ["--prefix-eviction lru applies to a --trace"]),
]


@pytest.mark.parametrize("extra,words", REFUSED, ids=[" ".join(extra) for extra, _ in REFUSED])
def test_a_copy_or_eviction_flag_that_changes_nothing_is_refused_by_name(extra, words, capsys,
                                                                         monkeypatch, tmp_path):
    def drawn(*args, **kwargs):
        raise AssertionError("the workload was drawn before the flag was refused")
    monkeypatch.setattr(cli, "generate", drawn)
    written = tmp_path / "trace.jsonl"
    code = main(SIM + extra + ["--write-trace", str(written)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("vmemkv simulate: error: "), err
    for word in words:
        assert word in err, (word, err)
    assert out == "" and not written.exists()


def _run(config: SimConfig) -> dict:
    spec = WorkloadSpec(num_requests=12, prompt_median=300, prompt_p95=900, output_mean=80,
                        output_p95=200, seed=0)
    figures = simulate(generate(spec), config).to_dict()
    figures.pop("wall_seconds")
    return figures


@pytest.mark.parametrize("policy,forks", [("paged", {"n": 3}), ("vmem", {"beam_width": 2})])
def test_on_a_generated_workload_eviction_changes_nothing_even_with_forks(policy, forks):
    """Why --prefix-eviction is refused there: every policy gives the same figures."""
    runs = [_run(SimConfig(policy=policy, cache_bytes=10**9, prefix_eviction=eviction, **forks))
            for eviction in ("off", "lru", "hits")]
    assert runs[0]["copied_kv_bytes"] > 0 and runs[0]["prefix_cache_queries"] == 0
    assert runs[1] == runs[0] and runs[2] == runs[0]


@pytest.mark.parametrize("policy", ["paged", "vmem", "reserve-max"])
def test_without_a_fork_nothing_is_copied_so_the_copy_bandwidth_changes_nothing(policy):
    slow, default = (_run(SimConfig(policy=policy, cache_bytes=10**9, copy_bytes_per_s=rate))
                     for rate in (1e9, None))
    assert slow["copied_kv_bytes"] == 0 and slow == default


def test_the_same_flags_are_accepted_and_act_where_something_is_copied_or_shared(capsys):
    def figures(argv) -> dict:
        assert main(argv) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)
    forked, slow = figures(SIM + ["--n", "2"]), figures(SIM + ["--n", "2", "--copy-gbps", "1"])
    copied = forked["copied_kv_bytes"]
    assert copied > 0 and slow["copied_kv_bytes"] == copied
    assert slow["config"]["copy_gbps"] == 1.0
    # every copied byte now costs 1 ns (1 GB/s) instead of the default's far less
    assert slow["simulated_seconds"] > forked["simulated_seconds"] + 0.9 * copied / 1e9
    kept = {e: figures(TRACE + ["--prefix-eviction", e]) for e in ("off", "hits")}
    assert kept["hits"]["prefix_cache_hits"] > 0
    assert kept["hits"]["config"]["prefix_eviction"] == "hits"
    # retention keeps the trace's shared prefixes mapped: fewer pages mapped again
    assert kept["hits"]["mapped_page_ops"] != kept["off"]["mapped_page_ops"]
    assert kept["hits"]["kv_utilization"] != kept["off"]["kv_utilization"]
