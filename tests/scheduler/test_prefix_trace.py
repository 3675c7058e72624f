"""The simulator on the Mooncake conversation trace: with ample memory the prefix hit rate equals
the trace's theoretical maximum, computed here from the hash ids alone (no manager, no token
ids); with less memory, retention and the hits policy do what the docs' table says."""
import pytest

from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.traces import MOONCAKE_BLOCK_TOKENS, fit_to_length, load_trace

REQUESTS = 300          # ~100 s of the trace: 0.78 M unique prompt tokens (102 GB of Llama-3-8B)
# more than the trace ever holds (its 102 GB of unique prompt tokens, 25% to spare): nothing is
# ever evicted (the hits equal those at 200 GB exactly); the manager's integrity check, run
# whenever the simulator idles, walks every page of the pool, so a larger one only costs time
AMPLE_BYTES = 128 * 10**9


def theoretical_hit_tokens(entries, unit_tokens):
    """Tokens an infinite cache serves when requests run one after another in arrival order:
    each request's longest prompt prefix (whole units, never its last token) that an earlier
    request held. Block j of a prompt covers min(512, prompt_len - 512 j) tokens of hash id j's
    block, chained on blocks < j."""
    covered = {}        # hash-id chain -> tokens of its last block some earlier prompt held
    hits = 0
    for e in sorted(entries, key=lambda e: e.arrival_s):
        best = 0
        for j in range(len(e.hash_ids)):
            c = covered.get(e.hash_ids[:j + 1])
            if c is None:
                break
            best = j * MOONCAKE_BLOCK_TOKENS + min(c, e.prompt_len - j * MOONCAKE_BLOCK_TOKENS)
            if c < MOONCAKE_BLOCK_TOKENS:
                break
        hits += min(best, e.prompt_len - 1) // unit_tokens * unit_tokens
        for j in range(len(e.hash_ids)):
            key = e.hash_ids[:j + 1]
            held = min(MOONCAKE_BLOCK_TOKENS, e.prompt_len - j * MOONCAKE_BLOCK_TOKENS)
            covered[key] = max(covered.get(key, 0), held)
    return hits


def entries(n=REQUESTS):
    return fit_to_length(load_trace("mooncake-conversation", max_requests=n), 4096)[0]


LAYOUTS = {"paged-16": dict(policy="paged", block_size=16),
           "vmem-interleaved": dict(policy="vmem", layout="interleaved")}


# Nothing is evicted with ample memory, so each retention policy runs on one layout (both
# layouts and both policies covered; the four combinations took 8 s of the suite).
@pytest.mark.parametrize("layout, eviction", [("paged-16", "lru"), ("vmem-interleaved", "hits")])
def test_with_ample_memory_the_hit_rate_is_the_traces_theoretical_maximum(layout, eviction):
    es = entries()
    result = simulate(es, SimConfig(cache_bytes=AMPLE_BYTES, prefix_eviction=eviction,
                                    **LAYOUTS[layout]))
    unit = 16 if layout == "paged-16" else 32          # Llama-3-8B: 32 tokens per 2 MiB page
    queries = sum(e.prompt_len for e in es)
    theory = theoretical_hit_tokens(es, unit) / queries
    assert result.prefix_cache_queries == queries
    assert result.prefix_cache_hits / queries == pytest.approx(theory, rel=0.01)
    assert result.prefix_cache_hits / queries > 0.2
    assert result.prefix_cache_hits <= theoretical_hit_tokens(es, unit)   # a maximum indeed


# 60 requests (20 s of the trace) hold enough concurrent sharing and later reuse: 20,992 hit
# tokens without retention, 29,184 with lru (at 150 requests, 50,176 and 84,176)
def test_without_retention_only_concurrent_requests_share():
    es = entries(60)
    off = simulate(es, SimConfig(cache_bytes=60 * 10**9, prefix_eviction="off"))
    lru = simulate(es, SimConfig(cache_bytes=60 * 10**9, prefix_eviction="lru"))
    assert off.prefix_cache_hits < lru.prefix_cache_hits


def test_theoretical_maximum_counts_only_earlier_prefixes():
    from vmemkv.scheduler.workload import TraceEntry
    a = TraceEntry(1024, 1, 0.0, (0, 1))
    b = TraceEntry(1100, 1, 1.0, (0, 1, 2))            # a's 1024 tokens
    c = TraceEntry(700, 1, 2.0, (0, 1))                # a's first 512 + 188 of block 1
    d = TraceEntry(600, 1, 3.0, (0, 5))                # block 0 only
    assert theoretical_hit_tokens([a, b, c, d], 16) == 1024 + 699 // 16 * 16 + 512


def test_simulate_cli_prefix_eviction_flag_reaches_the_managers(capsys):
    import json
    from vmemkv.cli import main
    hits = {}
    for eviction in ("off", "lru"):
        assert main(["simulate", "--trace", "mooncake-conversation", "--max-requests", "60",
                     "--prefix-eviction", eviction, "--json", "--no-progress"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["config"]["prefix_eviction"] == eviction
        hits[eviction] = out["prefix_cache_hits"]
    assert 0 < hits["off"] < hits["lru"]
