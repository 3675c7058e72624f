"""The plan-size benchmark's plumbing on a small batch (the 256-sequence figure is in
docs/benchmarks.md): decode plans send changes, so they stay far below whole block tables."""
from vmemkv.benchmarks import plan_size


def test_plan_size_reports_every_cache_kind_and_changes_beat_whole_tables():
    payload = plan_size.main(["--seqs", "32", "--decodes", "4"])
    rows = {r["cache"]: r for r in payload["results"]}
    assert set(rows) == {"vmem per-layer", "vmem interleaved", "paged"}
    for r in rows.values():
        assert 0 < r["decode_median_bytes"] <= r["decode_max_bytes"] < r["admission_bytes"]
    paged = rows["paged"]
    assert paged["decode_median_bytes"] * 2 < paged["whole_tables_decode_bytes"]
