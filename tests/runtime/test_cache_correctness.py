"""Random mixes of prefill, decode, fork, shared prefixes, preemption and swap through real
caches: after every step each sequence's cache contents equal the shadow copy, and every CPU
backend's attention equals dense attention over the true K/V.

On the host driver the memory past each request's mapped pages is really PROT_NONE, so a
backend that read past a request's length would kill the test process with SIGSEGV; and freed
slots keep stale pages mapped (deferred reclamation), so one that read past the length inside
mapped memory would see another request's data and fail the comparison.
"""
import pytest
import torch

from runtime.config import CacheConfig

from .harness import ShadowRun

KiB = 2**10
CPU_BACKENDS = ("sdpa", "reference")


def config(dtype=torch.float32):
    # per layer and token: 2 heads * 16 dims * 4 B = 128 B -> a 4 KiB page holds 32 tokens
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, max_batch=4,
                       max_context=64)


CASES = [
    pytest.param("vmem", dict(layout="per-layer", page_bytes=4 * KiB), id="vmem-per-layer"),
    pytest.param("vmem", dict(layout="interleaved", page_bytes=4 * KiB), id="vmem-interleaved"),
    pytest.param("vmem", dict(layout="per-layer", page_bytes=4 * KiB, background_mapper=True),
                 id="vmem-per-layer-mapper"),
    pytest.param("paged", dict(block_size=8), id="paged-8"),
]


@pytest.mark.parametrize("cache_kind,options", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_contents_and_attention_match_shadow_fp32(cache_kind, options, seed):
    cfg = config()
    # room for ~ 2.5 full-length sequences: preemption, swap and reclamation all happen
    cache_bytes = int(2.5 * cfg.max_context * cfg.bytes_per_token)
    run = ShadowRun(cfg, cache_kind, seed, backends=CPU_BACKENDS, cache_bytes=cache_bytes,
                    swap_bytes=cfg.max_context * cfg.bytes_per_token * 2, **options)
    events = run.run(60)
    assert run.checked_attention > 0
    assert events["decode"] > 50 and events["prefill"] > 5
    run.cache.close()


@pytest.mark.parametrize("cache_kind,options", CASES[:2] + CASES[3:])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_attention_matches_reference(cache_kind, options, dtype):
    cfg = config(dtype)
    run = ShadowRun(cfg, cache_kind, 7, backends=("sdpa",),
                    cache_bytes=int(2.5 * cfg.max_context * cfg.bytes_per_token),
                    swap_bytes=cfg.max_context * cfg.bytes_per_token, **options)
    run.run(30)
    assert run.checked_attention > 0
    run.cache.close()


@pytest.mark.parametrize("cache_kind,options", CASES)
def test_every_event_kind_happens_across_seeds(cache_kind, options):
    """The random mix really covers fork, prefix hits, both preemptions and swap-in."""
    cfg = config()
    totals = {}
    for seed in range(4):
        run = ShadowRun(cfg, cache_kind, 100 + seed, backends=(),
                        cache_bytes=int(2.5 * cfg.max_context * cfg.bytes_per_token),
                        swap_bytes=cfg.max_context * cfg.bytes_per_token * 2, **options)
        for key, value in run.run(80).items():
            totals[key] = totals.get(key, 0) + value
        run.cache.close()
    for key in ("fork", "prefix_hit_tokens", "preempt_recompute", "swap_out", "swap_in", "free"):
        assert totals[key] > 0, f"no {key} in {totals}"
