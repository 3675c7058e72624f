"""Memory pressure changes no output: the same requests (greedy, seeded sampling, n > 1, a beam
search, stop strings and ids, min_tokens, logprobs and prompt logprobs) give the same tokens,
text, finish and stop reasons, statuses and beam results on an engine whose cache preempts them
(recompute and swap, vmem and paged, prefix sharing, chunked prefill) as on one with room; their
logprobs and scores agree to fp32 rounding (a step's batch, which pressure changes, moves the
last bits of a logit). The scratch differential drew hundreds of such workloads (hypothesis)."""
from __future__ import annotations

import functools
import math
import random

import pytest

pytest.importorskip("transformers")

from vmemkv.runtime.engine import BeamSearchParams, Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.models import build_model  # noqa: E402

from .byte_tokenizer import byte_tokenizer  # noqa: E402

KiB = 1024
TIGHT = {   # tiny-llama: 128 B per token, layer and K (or V)
    "vmem-recompute": dict(cache="vmem", layout="per-layer", page_bytes=4 * KiB,
                           cache_bytes=64 * KiB, preemption="recompute"),
    "vmem-swap": dict(cache="vmem", layout="interleaved", page_bytes=4 * KiB,
                      cache_bytes=48 * KiB, preemption="swap", swap_bytes=1 << 20),
    "paged-recompute": dict(cache="paged", block_size=4, cache_bytes=24 * KiB,
                            preemption="recompute"),
    "paged-swap": dict(cache="paged", block_size=4, cache_bytes=24 * KiB, preemption="swap",
                       swap_bytes=1 << 20),
}


@functools.lru_cache(maxsize=None)
def _model():
    return build_model("tiny-llama", seed=0)


def _workload():
    rng = random.Random(32)
    base = [rng.randrange(256) for _ in range(24)]

    def prompt(n):
        return [rng.randrange(256) for _ in range(n)]
    sample = dict(temperature=1.0, top_k=40, ignore_eos=True)
    return [
        ("gen", base[:20] + prompt(4), SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                      logprobs=2)),
        ("gen", prompt(18), SamplingParams(max_new_tokens=18, seed=7, n=2, **sample)),
        ("beam", base[:17], BeamSearchParams(2, max_new_tokens=8, ignore_eos=True)),
        ("gen", base + prompt(3), SamplingParams(max_new_tokens=16, seed=3, min_tokens=6,
                                                 stop=("a", "e"), stop_token_ids=(5, 9),
                                                 prompt_logprobs=1, **sample)),
        ("gen", prompt(25), SamplingParams(max_new_tokens=22, min_tokens=4, logprobs=0,
                                           stop_token_ids=tuple(range(100, 140)))),
        ("gen", prompt(12), SamplingParams(max_new_tokens=20, ignore_eos=True, n=2,
                                           repetition_penalty=1.3)),
    ]


def _run(**config):
    with Engine(_model(), byte_tokenizer(), max_batch=4, max_context=64, check_integrity=True,
                **config) as engine:
        ids = [engine.add_beam_request(p, params) if kind == "beam" else
               engine.add_request(p, params) for kind, p, params in _workload()]
        engine.run_until_done()
        stats = engine.stats()
        outputs = [engine.output(rid) for rid in ids]
    return outputs, stats


def _exact(outputs) -> list:
    return [(o.status, o.error, [(c.token_ids, c.finish_reason, c.stop_reason, c.text,
                                  None if c.logprobs is None else
                                  [(e.token_id, [t for t, _ in e.top]) for e in c.logprobs])
                                 for c in o.outputs],
             None if o.prompt_logprobs is None else
             [None if e is None else (e.token_id, e.rank) for e in o.prompt_logprobs])
            for o in outputs]


def _numbers(outputs) -> list:
    numbers = []
    for o in outputs:
        for c in o.outputs:
            numbers += [c.beam_score or 0.0, c.cumulative_logprob or 0.0]
            numbers += [e.logprob for e in c.logprobs or ()]
        numbers += [e.logprob for e in o.prompt_logprobs or () if e is not None]
    return numbers


@functools.lru_cache(maxsize=None)
def _ample():
    return _run()


CASES = {   # name: (tight cache, prefix_sharing, max_tokens_per_step)
    "vmem-recompute": ("vmem-recompute", False, 2048),
    "vmem-swap-prefix-chunked": ("vmem-swap", True, 8),
    "paged-recompute-prefix-chunked": ("paged-recompute", True, 8),
    "paged-swap": ("paged-swap", False, 2048),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_do_not_depend_on_memory_pressure(case):
    tight, prefix, step_tokens = CASES[case]
    want, roomy = _ample()
    got, stats = _run(**TIGHT[tight], prefix_sharing=prefix, max_tokens_per_step=step_tokens)
    assert roomy.num_preemptions == 0 and stats.num_preemptions > 0
    swapping = TIGHT[tight]["preemption"] == "swap"
    assert (stats.num_swap_preemptions > 0) == swapping
    assert [o.status for o in got] == ["finished"] * len(want)
    assert _exact(got) == _exact(want)
    a, b = _numbers(got), _numbers(want)
    assert len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5)
                                    for x, y in zip(a, b))
    assert (stats.requests, stats.prompt_tokens, stats.output_tokens) == \
        (roomy.requests, roomy.prompt_tokens, roomy.output_tokens)


def _blocked_group_workload():
    """Samples (n = 1..3, seeded) and two beam searches over one shared prefix."""
    rng = random.Random(5)
    base = [rng.randrange(256) for _ in range(30)]
    work = []
    for i in range(5):
        prompt = (base[: 10 + 2 * i] + [rng.randrange(256) for _ in range(3)])[:28]
        if i % 3 == 0:
            work.append(("beam", prompt, BeamSearchParams(2 + i % 2, max_new_tokens=12,
                                                          ignore_eos=True)))
        else:
            work.append(("gen", prompt, SamplingParams(max_new_tokens=20, n=1 + i % 3, seed=i,
                                                       temperature=0.9, ignore_eos=True)))
    return work


def _run_work(work, **config):
    with Engine(_model(), max_batch=4, max_context=64, check_integrity=True, **config) as engine:
        ids = [engine.add_beam_request(p, params) if kind == "beam" else
               engine.add_request(p, params) for kind, p, params in work]
        engine.run_until_done()
        outputs = [engine.output(rid) for rid in ids]
    return [(o.status, o.error, [c.token_ids for c in o.outputs]) for o in outputs]


def test_sequence_swapped_in_beside_a_blocked_beam_group_is_not_failed():
    """A sample swapped back in got no room for its next token while a beam group waited for
    a beam (forked into no room) that could not be admitted: nothing ran, so the sample was
    failed "sequence 8 (33 tokens) gets no room to grow in a cache of 64 tokens" though it
    fits the cache alone. The blocked group is preempted instead (beam_groups._unblock_groups)
    and every request ends as it does with room."""
    work = _blocked_group_workload()
    want = _run_work(work)
    got = _run_work(work, cache="paged", block_size=4, cache_bytes=32 * KiB, preemption="swap",
                    swap_bytes=16 * KiB, prefix_sharing=True)
    assert [status for status, _, _ in got] == ["finished"] * 5
    assert got == want


def test_beams_forked_into_no_room_share_a_swapped_in_leader_with_prefix_sharing():
    """Two beams forked into no room joined their leader, swapped back in (its history held
    unpublished), through the prefix cache only, which found none of it: each held its own
    copy of the 19-token prompt and the group failed "sequence 5 (21 tokens, one of the 3 beams
    of a beam search, ...) cannot grow in a cache of 64 tokens" where it ran with room. They
    hold the leader's units of what they share (beam_groups._place_private), as without
    prefix sharing."""
    work = [_blocked_group_workload()[i] for i in (1, 3, 4)]
    want = _run_work(work)
    got = _run_work(work, cache="paged", block_size=4, cache_bytes=32 * KiB, preemption="swap",
                    swap_bytes=16 * KiB, prefix_sharing=True)
    assert [status for status, _, _ in got] == ["finished"] * 3
    assert got == want
