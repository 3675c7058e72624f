"""Random mixes of prefill, decode, fork, shared prefixes, preemption and swap through real
caches: after every step each sequence's cache contents equal the shadow copy, and every CPU
backend's attention equals dense attention over the true K/V. At the end of the file the same
mixes run on CUDA caches with every CUDA backend (GPU tests, run by benchmarks/gpu_check.sh).

On the host driver the memory past each request's mapped pages is really PROT_NONE, so a
backend that read past a request's length would kill the test process with SIGSEGV; and freed
slots keep stale pages mapped (deferred reclamation), so one that read past the length inside
mapped memory would see another request's data and fail the comparison.
"""
import pytest
import torch

from vmemkv.runtime.config import CacheConfig

from .harness import ShadowRun

KiB = 2**10
CPU_BACKENDS = ("sdpa", "reference", "cpu-varlen")


def config(dtype=torch.float32, kv_cache_dtype="auto", head_dim=16):
    # per layer and token: 2 heads * 16 dims * 4 B = 128 B -> a 4 KiB page holds 32 tokens
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=dtype, max_batch=4,
                       max_context=64, kv_cache_dtype=kv_cache_dtype)


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


@pytest.mark.parametrize("cache_kind,options,seed", [   # seeds where a swap-in happens
    pytest.param("vmem", dict(layout="per-layer", page_bytes=4 * KiB), 5, id="vmem-per-layer"),
    pytest.param("vmem", dict(layout="interleaved", page_bytes=4 * KiB), 1, id="vmem-interleaved"),
    pytest.param("paged", dict(block_size=8), 0, id="paged-8")])
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_encoded_contents_survive_swap_fork_and_prefix_hits_and_attention_reads_them(
        cache_kind, options, seed, kv):
    """A cache storing ``kv_cache_dtype`` under an fp32 model holds, byte for byte, the
    encoding of the truth with its fixed scales after every move (swap, copy-on-write, prefix
    hits), and every CPU backend equals fp32 attention over the decoded truth (1e-5)."""
    size = config(kv_cache_dtype=kv).element_bytes
    cfg = config(kv_cache_dtype=kv, head_dim=16 * 4 // size)   # 128 B a layer-token, as fp32's
    cache_bytes = int(2.5 * cfg.max_context * cfg.bytes_per_token)
    run = ShadowRun(cfg, cache_kind, seed, backends=CPU_BACKENDS, cache_bytes=cache_bytes,
                    swap_bytes=cfg.max_context * cfg.bytes_per_token * 2, **options)
    events = run.run(30)
    assert run.checked_attention > 0 and events["swap_in"] and events["fork"]
    assert events["prefix_hit_tokens"] or cache_kind == "vmem"
    assert run.cache.kv_scales is None or (run.cache.kv_scales.fixed == [True, True]
                                           and not torch.equal(run.cache.kv_scales.k, torch.ones(2, 2)))
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


# ---- the same random mixes on CUDA (benchmarks/gpu_check.sh runs these) -----------------------
# Real caches on the CUDA driver (2 MiB pages), fp16, every CUDA backend that can run the case.
# Heads are Llama-sized so that pages hold few enough tokens to be crossed: per layer and token
# 8 heads x 128 dims x 2 B = 2 KiB, so a per-layer page holds 1,024 tokens and an interleaved
# one (both layers) 512.
MiB = 2**20
GPU = [pytest.mark.gpu]
LARGE_CASES = [
    pytest.param("vmem", dict(layout="per-layer", page_bytes=2 * MiB), 2048, id="vmem-per-layer"),
    pytest.param("vmem", dict(layout="interleaved", page_bytes=2 * MiB), 1536, id="vmem-interleaved"),
    pytest.param("vmem", dict(layout="per-layer", page_bytes=2 * MiB, background_mapper=True), 2048,
                 id="vmem-per-layer-mapper"),
    pytest.param("paged", dict(block_size=16), 1536, id="paged-16"),
    pytest.param("paged", dict(block_size=256), 1536, id="paged-256"),
]


def large_mix(device: str, cache_kind: str, options: dict, max_context: int, steps: int,
              backends=None) -> tuple[ShadowRun, dict]:
    """Random mix on Llama-sized heads in fp16; ``backends`` default: every available backend
    that runs on ``device`` for this layout (flash-attn's paged path only with 256-token blocks)."""
    from vmemkv.runtime.attention import availability, backend_class
    cfg = CacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float16,
                      device=device, max_batch=4, max_context=max_context)
    if backends is None:
        layout = "paged" if cache_kind == "paged" else "vmem"
        backends = [name for name in ("reference", "sdpa", "flash", "flash-attn")
                    if availability(name) and device.split(":")[0] in backend_class(name).devices
                    and layout in backend_class(name).kinds
                    and not (name == "flash-attn" and layout == "paged" and options["block_size"] % 256)]
    # room for 1.5 full-length sequences: sequences crossing a page make others preempt or swap
    run = ShadowRun(cfg, cache_kind, 11, backends=backends, num_heads=32,
                    cache_bytes=int(1.5 * max_context * cfg.bytes_per_token),
                    swap_bytes=max_context * cfg.bytes_per_token * 2, **options)
    return run, run.run(steps)


@pytest.mark.parametrize("cache_kind,options,max_context", LARGE_CASES)
@pytest.mark.gpu
def test_random_mix_on_cuda_matches_shadow_and_dense_attention(cache_kind, options, max_context):
    run, events = large_mix("cuda", cache_kind, options, max_context, steps=120)
    try:
        # seed 11 gives the same draws and decisions on any device (checked on the host driver
        # with the same 2 MiB pages): forks, recompute and swap preemptions, swap-ins, frees
        assert run.checked_attention > 0 and events["decode"] > 200
        for kind in ("fork", "preempt_recompute", "swap_out", "swap_in", "free"):
            assert events[kind] > 0, f"no {kind} in {events}"
        names = {type(b).name for b in run.backends}
        assert {"sdpa", "flash"} <= names, names       # the flash backend really ran
    finally:
        run.cache.close()


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
@pytest.mark.parametrize("max_context", [100, 256, 1000])
def test_make_kv_rounds_a_slot_up_to_its_default_pages_as_the_engine_does(layout, max_context):
    # the default 64 KiB host page holds 512 tokens per layer of this model (128 B each), 256
    # interleaved: a max_context that is no multiple of that was refused by the default itself
    from vmemkv.runtime.kv import make_kv
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2,
                      max_context=max_context)
    kv = make_kv(cfg, layout=layout)
    try:
        per_page = {"per-layer": 512, "interleaved": 256}[layout]
        slot_tokens = -(-max_context // per_page) * per_page
        assert kv.manager.page_bytes == 64 * KiB
        assert kv.manager.max_seq_len == kv.cache.config.max_context == slot_tokens
        assert kv.manager.max_sequence_tokens == slot_tokens        # every slot fits whole
        kv.check_integrity()
    finally:
        kv.cache.close()
