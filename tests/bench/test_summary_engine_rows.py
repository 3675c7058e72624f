"""The bench summary's engine rows: step-split notes, the packed forward-only row, long-prompt ITL."""
import pytest

from vmemkv.benchmarks.summary import engine_column, format_summary, summary_rows

ENGINE = {"rows": [
    {"system": "vmem per-layer", "tok_s": 2000.0, "map_share": 0.001, "attn": 0.25,
     "overhead": 0.04, "vs_hf": 5.0, "tok_s_runs": [1900.0, 2000.0, 2100.0]},
    {"system": "paged bs16", "tok_s": 1800.0, "attn": 0.3, "overhead": 0.05, "vs_hf": 4.5},
    {"system": "model forward only (packed batch)", "tok_s": 2600.0, "vs_hf": 6.5},
    {"system": "transformers generate_batch", "tok_s": 400.0, "vs_hf": 1.0}],
    "long_prompts": {"rows": [{"system": "vmem cpu-varlen", "itl_p50_ms": 10.0},
                              {"system": "paged cpu-varlen", "itl_p50_ms": 21.0}],
                     "paged_over_vmem_itl": {"cpu-varlen": 2.1}}}


def test_engine_rows_carry_the_step_split_and_the_packed_forward_goes_with_vmem():
    rows = {r["what"]: r for r in summary_rows({"engine": ENGINE}, ["engine"])}
    vmem = rows["engine vmem per-layer"]
    assert vmem["vmem"] == 2000.0 and "attn 25.0%" in vmem["note"] and "overhead 4.0%" in vmem["note"]
    packed = rows["engine model forward only (packed batch)"]   # no bound: [1, T] packed ids
    assert packed["vmem"] == 2600.0 and "not a bound" in packed["note"]
    assert engine_column("model forward only (packed batch)") == "vmem"
    assert rows["engine transformers generate_batch"]["transformers"] == 400.0


def test_long_prompt_itl_row_puts_vmem_and_paged_side_by_side():
    rows = {r["what"]: r for r in summary_rows({"engine": ENGINE}, ["engine"])}
    itl = rows["ITL p50, 3-4k prompts, cpu-varlen"]
    assert (itl["vmem"], itl["paged"], itl["unit"]) == (10.0, 21.0, "ms")
    assert "2.10x" in itl["note"]
    assert "ITL p50, 3-4k prompts" in format_summary(list(rows.values()))


def test_attention_baselines_are_timed_beside_the_fastest_and_kept_apart():
    from vmemkv.benchmarks import attention
    payload = attention.run(argv=["--batches", "2", "--contexts", "32", "--heads", "4",
                                  "--kv-heads", "2", "--head-dim", "16", "--repeats", "1",
                                  "--baselines", "sdpa", "reference"], device="cpu")
    assert {r["baseline"] for r in payload["results"]} == {False}
    assert {r["backend"] for r in payload["baselines"]} == {"sdpa", "reference"} - {
        payload["results"][0]["backend"]}
    ratios = payload["baseline_ratios"]
    assert len(ratios) == len(payload["baselines"]) and all(r["baseline_over_backend"] > 0
                                                            for r in ratios)


def test_attention_configs_phases_flush_and_baseline_options_select_what_is_timed():
    from vmemkv.benchmarks import attention
    payload = attention.run(argv=["--configs", "1x40", "--phases", "decode", "--heads", "4",
                                  "--kv-heads", "2", "--head-dim", "16", "--repeats", "1",
                                  "--flush-mib", "1",
                                  "--baselines", "cpu-varlen:work_units=1,split_min_keys=8"],
                            device="cpu")
    assert [(r["batch"], r["ctx"], r["phase"]) for r in payload["results"]] == [(1, 40, "decode")] * 2
    assert {r["backend"] for r in payload["baselines"]} == {"cpu-varlen:work_units=1,split_min_keys=8"}
    with pytest.raises(SystemExit):
        attention.parse_args(["--configs", "8"])     # not BATCHxCTX: argparse's usage error
