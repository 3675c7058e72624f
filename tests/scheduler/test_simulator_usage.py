"""The simulator's kv_cache_usage_perc is vLLM's: groups or blocks kept only as a prefix cache
(refs 0, evictable) count as free, as ``MemoryManager.kv_cache_usage`` and the engine's
metrics count them. Requests that run one at a time with retention on therefore report the
same usage as one of them alone, on every policy."""
import pytest

from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import TraceEntry


def _one_at_a_time(n: int) -> list:
    # distinct prompts (own hash blocks), each arriving long after the previous one finished
    return [TraceEntry(prompt_len=1024, output_len=64, arrival_s=100.0 * i,
                       hash_ids=(2 * i, 2 * i + 1)) for i in range(n)]


@pytest.mark.parametrize("policy", ["vmem", "paged"])
def test_cached_memory_left_by_finished_requests_is_not_counted_as_used(policy):
    config = SimConfig(model="llama-3-8b", device="h200", cache_bytes=8 * 2**30,
                       max_seq_len=4096, policy=policy, prefix_eviction="lru")
    alone = simulate(_one_at_a_time(1), config)
    after_others = simulate(_one_at_a_time(4), config)
    assert after_others.prefix_cache_hits == 0 < after_others.prefix_cache_queries
    assert 0.0 < alone.kv_cache_usage_perc < 1.0
    assert after_others.kv_cache_usage_perc == pytest.approx(alone.kv_cache_usage_perc, rel=1e-9)
