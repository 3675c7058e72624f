"""Beam search in the engine equals transformers' generate(num_beams=k, do_sample=False) on every
cache layout, under preemption, with stop ids, length penalties and early stopping."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import RequestRejectedError

from ..vmem_only_options import options_for
from .beam_reference import beam_mismatches, hf_beams
from .conftest import model, prompts

CACHES = {
    "vmem-per-layer": dict(cache="vmem", layout="per-layer"),
    "vmem-interleaved": dict(cache="vmem", layout="interleaved"),
    "paged": dict(cache="paged", block_size=4),
}


def run(family, batch, params, **options):
    with Engine(model(family), max_context=128, check_integrity=True,
                **{"max_batch": 8, **options}) as engine:
        out = engine.beam_search(batch, params)
        stats = engine.last_stats
        assert engine.kv.manager.stats().live_tokens == 0   # every beam's memory is back
    return out, stats


def reference(family, batch, params, stop_ids):
    return [hf_beams(family, tuple(p), params.beam_width, params.max_new_tokens,
                     params.length_penalty, params.early_stopping, stop_ids) for p in batch]


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("family,k", [("tiny-llama", 2), ("tiny-qwen2", 4), ("tiny-llama", 6)])
def test_beams_equal_transformers(family, k, cache):
    batch = prompts(2, 3, 30, seed=k)
    params = BeamSearchParams(k, max_new_tokens=8, ignore_eos=True)
    out, _ = run(family, batch, params, **CACHES[cache])
    assert not beam_mismatches(out, reference(family, batch, params, ()))
    assert all(o.status == "finished" and len(o.outputs) == k for o in out)


@pytest.mark.parametrize("length_penalty,early_stopping", [
    (1.0, False), (0.0, True), (2.0, "never"), (-0.5, False)])
def test_stop_ids_length_penalty_and_early_stopping_equal_transformers(length_penalty,
                                                                       early_stopping):
    # stop ids the beams do pick, so hypotheses finish early and the stopping rules matter
    batch = prompts(3, 4, 20, seed=7)
    stop_ids = tuple(range(0, 256, 16))   # 16 stop ids: 17 * k candidates a step
    params = BeamSearchParams(4, max_new_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping, ignore_eos=True,
                              stop_token_ids=stop_ids)
    out, _ = run("tiny-llama", batch, params, cache="paged", block_size=4)
    ref = reference("tiny-llama", batch, params, stop_ids)
    assert not beam_mismatches(out, ref)
    assert any(c.finish_reason == "stop" for o in out for c in o.outputs)


def test_cumulative_logprob_is_the_score_times_the_length_penalty():
    batch = prompts(1, 5, 5, seed=3)
    params = BeamSearchParams(3, max_new_tokens=6, length_penalty=1.5, num_return_beams=2,
                              ignore_eos=True)
    (out,), _ = run("tiny-llama", batch, params)
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 6
        assert c.cumulative_logprob == pytest.approx(c.beam_score * 6 ** 1.5, abs=1e-4)
    assert out.outputs[0].beam_score >= out.outputs[1].beam_score


@pytest.mark.parametrize("cache,cache_kib", [("vmem", 96), ("paged", 64)])
def test_beams_equal_transformers_under_recompute_preemption(cache, cache_kib):
    # a cache too small for both groups at once: groups are preempted whole and recomputed
    # (each must then fit without sharing: vmem's 4 KiB pages need the larger cache); 8 rows
    # for 16 beams: children that find no row wait, so groups are split when preempted
    batch = prompts(4, 20, 30, seed=5)
    params = BeamSearchParams(4, max_new_tokens=10, ignore_eos=True)
    out, stats = run("tiny-llama", batch, params, cache=cache, block_size=4,
                     cache_bytes=cache_kib * 1024, preemption="recompute",
                     **options_for(cache, page_bytes=4096))
    assert stats.num_preemptions > 0 and stats.num_swap_preemptions == 0
    assert not beam_mismatches(out, reference("tiny-llama", batch, params, ()))


@pytest.mark.parametrize("cache,cache_kib", [
    ("vmem-per-layer", 128), ("vmem-interleaved", 96), ("paged", 64)])
def test_beams_equal_transformers_under_swap_preemption(cache, cache_kib):
    # rows for every beam: a group runs whole, is swapped out whole (each beam its own copy of
    # what they share) and swapped back whole into private memory
    batch = prompts(4, 20, 30, seed=5)
    params = BeamSearchParams(4, max_new_tokens=10, ignore_eos=True)
    out, stats = run("tiny-llama", batch, params, **{**CACHES[cache], "block_size": 4},
                     cache_bytes=cache_kib * 1024, max_batch=16, preemption="swap",
                     swap_bytes=256 * 1024, **options_for(CACHES[cache]["cache"], page_bytes=4096))
    assert stats.num_swap_preemptions > 0 and stats.num_swap_preemptions % 4 == 0  # whole groups
    assert not beam_mismatches(out, reference("tiny-llama", batch, params, ()))


@pytest.mark.parametrize("cache_kib", [28, 48])
def test_a_request_swapped_or_recomputed_in_a_batch_finishes_where_it_finishes_alone(cache_kib):
    """Groups swapped out of shared memory come back recomputed where they cannot come back
    privately, sharing their history again (each beam a copy of it, before: 5 of 30 beam
    searches in a server's chaos run failed; here 3 of 4 at 28-48 KiB), so a request finishes
    in the batch exactly when it finishes alone; one too large for the cache alone fails
    alone, by name, and the others finish (it had raised out of beam_search with every
    request stuck, and a server failed all its live requests)."""
    batch = prompts(4, 20, 30, seed=5)
    params = BeamSearchParams(4, max_new_tokens=10, ignore_eos=True)
    options = dict(cache="paged", block_size=4, cache_bytes=cache_kib * 1024, max_batch=16,
                   preemption="swap", swap_bytes=256 * 1024)
    out, stats = run("tiny-llama", batch, params, **options)
    alone = [run("tiny-llama", [p], params, **options)[0][0] for p in batch]
    assert stats.num_swap_preemptions > 0
    assert [o.status for o in out] == [a.status for a in alone]
    for i in [i for i, o in enumerate(out) if o.status == "failed"]:
        assert out[i].error.type == "RequestTooLargeError" and "(37 tokens, one of the 4 beams " \
            "of a beam search, which hold a unit each and run together) cannot grow in a cache " \
            "of 56 tokens" in out[i].error.message
    finished = [i for i, o in enumerate(out) if o.status == "finished"]
    assert len(finished) == (3 if cache_kib == 28 else 4)
    ref = reference("tiny-llama", batch, params, ())
    assert not beam_mismatches([out[i] for i in finished], [ref[i] for i in finished])


def test_beams_equal_transformers_with_chunked_prefill_under_preemption():
    # an 8-token step budget: prompts and every recompute run in chunks over several steps,
    # the beams of a recomputed group wait for each other before they sample again
    batch = prompts(3, 18, 26, seed=8)
    params = BeamSearchParams(2, max_new_tokens=10, ignore_eos=True)
    out, stats = run("tiny-llama", batch, params, cache="paged", block_size=4, max_batch=8,
                     max_tokens_per_step=8, cache_bytes=40 * 1024)
    assert stats.num_preemptions > 0
    assert not beam_mismatches(out, reference("tiny-llama", batch, params, ()))


@pytest.mark.parametrize("cache", list(CACHES))
def test_windowed_model_beams_equal_transformers(cache):
    # prompts past the 32-token window: beams fork while memory behind it is given back
    # (page groups of 32 tokens on vmem per-layer and 16 interleaved, 4-token blocks on paged:
    # each gives some back)
    batch = prompts(2, 40, 52, seed=6)
    params = BeamSearchParams(2, max_new_tokens=14, ignore_eos=True)   # to 66 tokens
    out, _ = run("tiny-mistral-swa", batch, params, **{**CACHES[cache], "block_size": 4},
                 **options_for(CACHES[cache]["cache"], page_bytes=4096))
    assert not beam_mismatches(out, reference("tiny-mistral-swa", batch, params, ()))


@pytest.mark.parametrize("cache,cache_kib", [("vmem", 32), ("paged", 6)])
def test_a_beam_group_that_cannot_hold_a_unit_per_beam_is_refused_when_added(cache, cache_kib):
    # each beam writes its first output token into a unit of its own, beside the prompt's
    # whole units: fp8 K/V on 4 KiB pages makes 128-token page groups of 4 pages, so 3 beams
    # over a 29-token prompt hold 3 groups (12 pages) from their first decode, more than 32
    # KiB's 8 pages (paged, 16-token blocks: 1 + 3 blocks > 6 KiB's 3). Before: accepted, then
    # failed after its prefill. One more unit's room runs it.
    options = dict(cache=cache, max_batch=4, max_context=128, kv_cache_dtype="fp8_e4m3",
                   **({"page_bytes": 4096} if cache == "vmem" else {"block_size": 16}))
    params, prompt = BeamSearchParams(3, max_new_tokens=4, ignore_eos=True), list(range(3, 32))
    need, total, what = (12, 8, "pages") if cache == "vmem" else (4, 3, "blocks")
    with Engine(model(), cache_bytes=cache_kib * 1024, **options) as engine:
        assert engine.scheduler.total_tokens == (256 if cache == "vmem" else 48)
        with pytest.raises(RequestRejectedError, match=f"a beam search of 3 beams over a "
                                                       f"29-token prompt holds at least {need} "
                                                       f"{what} .* more than the cache's {total}"
                           ) as refused:
            engine.add_beam_request(prompt, params)
        assert refused.value.field == "beam_width"       # was "prompt", on either cache,
        assert "request " not in str(refused.value)      # naming an id nobody was given
        assert not engine.has_unfinished() and engine.kv.manager.stats().live_tokens == 0
        assert engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2)) is not None
    with Engine(model(), cache_bytes=cache_kib * 1024 * need // total, **options) as engine:
        (out,) = engine.beam_search([prompt], params)
        assert out.status == "finished" and len(out.outputs) == 3


def test_abort_frees_every_beam_and_keeps_the_beams_so_far():
    with Engine(model(), max_batch=8, max_context=64, check_integrity=True) as engine:
        rid = engine.add_beam_request([5, 6, 7], BeamSearchParams(4, max_new_tokens=20,
                                                                  ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert engine.status(rid) == "running"
        out = engine.abort(rid)
        assert out.status == "aborted" and not engine.has_unfinished()
        assert engine.kv.manager.stats().live_tokens == 0
        assert len(out.outputs) == 4 and all(c.finish_reason == "abort" and len(c.token_ids) == 4
                                             for c in out.outputs)


def beam_state(engine) -> tuple:
    """conftest's engine_state, K/V read only where the cache has placed a sequence (a child
    forked by the last update is placed by the next plan), and the beams' records."""
    sched, mgr, cache = engine.scheduler, engine.kv.manager, engine.kv.cache
    seqs = {i: (s.state, s.num_computed, s.held, tuple(s.output)) for i, s in sched.seqs.items()}
    queues = tuple(tuple(s.seq_id for s in q) for q in (sched.waiting, sched.running))
    placed = [s for s in sched.running if s.seq_id in cache.placed_seq_ids]
    kv = {(s.seq_id, layer): tuple(t.numpy().tobytes() for t in cache.read(s.seq_id, layer,
                                                                             s.num_computed))
          for s in placed for layer in range(cache.config.num_layers)}
    beams = {rid: (g.beams, g.hyps) for rid, g in engine._beams.groups.items()}
    pages = [mgr.mapped_pages(slot) for slot in range(mgr.num_slots)]
    return queues, seqs, mgr.stats(), pages, cache.range.mapped_pages(), kv, beams


def recorded(engine) -> tuple:
    """What a step records: queues, each sequence's progress and tokens, the beams."""
    sched = engine.scheduler
    return (tuple(s.seq_id for s in sched.running), tuple(s.seq_id for s in sched.waiting),
            {i: (s.state, s.num_computed, tuple(s.output)) for i, s in sched.seqs.items()},
            {rid: (g.beams, g.hyps) for rid, g in engine._beams.groups.items()})


def test_a_fault_at_every_map_and_an_interrupt_after_the_selection_leave_no_trace():
    """Every step is first failed at each of its map calls (each leaves scheduler, manager,
    memory and the beams as before the step), then interrupted inside its recording, after the
    beams were pruned and branched, before the scheduler's update (nothing of it is recorded);
    the beams still equal transformers'."""
    from vmemkv import vmem
    from vmemkv.runtime.errors import PlanExecutionError
    from vmemkv.vmem.faults import FaultInjectingDriver

    driver = FaultInjectingDriver(vmem.open_driver("host"))
    batch = prompts(2, 6, 30, seed=9)
    params = BeamSearchParams(3, max_new_tokens=8, ignore_eos=True)
    with Engine(model(), driver=driver, cache="vmem", page_bytes=4096, max_batch=6,
                max_context=64, check_integrity=True, max_plan_retries=10**6) as engine:
        ids = [engine.add_beam_request(p, params) for p in batch]
        update, faults, interrupts = engine.scheduler.update, 0, 0

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        while engine.has_unfinished():
            for call in range(10**6):
                before = beam_state(engine), engine.status(ids[0])
                driver.fail_at("map", call)
                try:
                    engine.step()
                except PlanExecutionError:
                    assert (beam_state(engine), engine.status(ids[0])) == before
                    faults += 1
                    continue
                finally:
                    driver.disarm()
                break
            if not engine.has_unfinished():
                break
            engine.scheduler.update = interrupted
            try:
                before = recorded(engine)
                with pytest.raises(KeyboardInterrupt):
                    engine.step()
                assert recorded(engine) == before   # the plan's memory stays (its tokens rerun)
                interrupts += 1
            finally:
                engine.scheduler.update = update
        out = [engine.output(rid, pop=True) for rid in ids]
    assert faults >= 5 and interrupts >= 5
    assert not beam_mismatches(out, reference("tiny-llama", batch, params, ()))


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_beam_and_plain_requests_share_an_engine_with_prefix_sharing(cache):
    """Beam groups and greedy samples (n = 2) batched in one engine with prefix sharing on:
    each equals transformers alone."""
    from vmemkv.runtime.engine import SamplingParams

    from .conftest import hf_greedy

    batch = prompts(3, 16, 24, seed=4)
    beams = BeamSearchParams(3, max_new_tokens=8, ignore_eos=True)
    with Engine(model(), cache=cache, block_size=4, max_batch=8, max_context=64,
                prefix_sharing=True, check_integrity=True,
                **options_for(cache, page_bytes=4096)) as engine:
        plain = [engine.add_request(batch[0], SamplingParams(max_new_tokens=8, n=2,
                                                              ignore_eos=True))]
        searched = [engine.add_beam_request(p, beams) for p in batch[1:] + batch[:1]]
        engine.run_until_done()
        greedy = engine.output(plain[0], pop=True)
        out = [engine.output(rid, pop=True) for rid in searched]
        assert engine.kv.manager.stats().live_tokens == 0
    assert [c.token_ids for c in greedy.outputs] == hf_greedy("tiny-llama", batch[:1], 8,
                                                              ignore_eos=True) * 2
    assert not beam_mismatches(out, reference("tiny-llama", batch[1:] + batch[:1], beams, ()))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_at_calls_of_a_beam_search_drops_and_duplicates_nothing():
    """Calls (a stride of them) of the engine's, the scheduler's and the managers' code in a
    beam search (selection, prune, branch, fork, copy-on-write included) are interrupted once
    each; the resumed run returns exactly the uninterrupted beams and holds nothing after."""
    from .test_interrupt_atomicity import Interrupter

    batch = prompts(2, 5, 9, seed=3)
    params = BeamSearchParams(3, max_new_tokens=4, ignore_eos=True, stop_token_ids=(7,))
    with Engine(model(), cache="paged", block_size=4, max_batch=6, max_context=64) as engine:
        def outcome(outputs):
            return [(o.status, [(c.token_ids, c.beam_score, c.finish_reason) for c in o.outputs])
                    for o in outputs]
        want = outcome(engine.beam_search(batch, params))
        interrupter, k, interrupts = Interrupter("call"), 1, 0
        while True:
            ids = [engine.add_beam_request(p, params) for p in batch]
            interrupter.arm(k)
            try:
                engine.run_until_done()
            except KeyboardInterrupt:
                pass
            finally:
                fired = interrupter.disarm()
            engine.run_until_done()
            where = f"interrupt at call {k} ({interrupter.where})"
            assert outcome([engine.output(rid, pop=True) for rid in ids]) == want, where
            engine.kv.manager.check_integrity()
            assert engine.kv.manager.stats().live_tokens == 0 and not engine.has_unfinished()
            if not fired:
                break
            interrupts, k = interrupts + 1, k + 29
    assert interrupts >= 40


@pytest.mark.parametrize("max_kib,prompt_len,new_tokens,status", [
    (256, 30, 60, "finished"), (160, 40, 80, "finished"), (112, 40, 80, "failed"),
    (96, 40, 80, "refused")])
def test_a_beam_group_on_a_memory_budget_grows_its_pool_to_come_back_or_fails_at_its_max(
        max_kib, prompt_len, new_tokens, status):
    """A group preempted out of shared memory comes back with each beam's own copy: on a pool a
    MemoryBudget resizes, its head fits alone but the group does not, and nothing runs. The
    budget grows the pool until the group fits (tokens as transformers'), or, at the pool's
    max, the request fails alone (at 96 KiB even the least the group holds, 28 pages, is past
    the max: refused when added, as on a fixed pool). Before, the budget saw only the head, the
    pool stayed put
    and the request waited for ever (2,000 steps at 96 KiB and 80 KiB of these maxes); then
    the budget's grow step (12 KiB of 96) was below the pool's (16 KiB, 4 pages), which
    rounded it to nothing (stuck at 64 KiB); and a group came back as private copies, which
    160 KiB could not hold."""
    from vmemkv.scheduler.budget import MemoryBudget
    budget = MemoryBudget(4096 * 1024, idle_release_s=1.0, clock=lambda: 0.0)
    prompt = [(j * 7) % 256 for j in range(prompt_len)]
    params = BeamSearchParams(4, max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(model("tiny-llama"), memory_budget=budget, cache_bytes=64 * 1024,
                min_cache_bytes=32 * 1024, max_cache_bytes=max_kib * 1024, max_batch=8,
                max_context=128, cache="vmem", layout="per-layer", page_bytes=4096,
                preemption="recompute", check_integrity=True) as engine:
        if status == "refused":
            with pytest.raises(RequestRejectedError, match="more than the cache's 24 pages"):
                engine.add_beam_request(prompt, params)
            assert not engine.has_unfinished()
            return
        rid = engine.add_beam_request(prompt, params)
        for _ in range(500):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished(), f"stuck at {engine.cache_bytes} bytes"
        assert engine.scheduler.metrics.num_preemptions > 0
        out = engine.output(rid, pop=True)
        assert engine.kv.manager.stats().live_tokens == 0
    assert out.status == status, out.error
    if status == "finished":
        assert not beam_mismatches([out], reference("tiny-llama", [prompt], params, ()))
    else:
        assert out.error.type == "RequestTooLargeError" and "(its max)" in out.error.message


def test_a_recomputed_group_its_prefix_hits_cover_decodes_instead_of_thrashing():
    """Two sampled continuations and a 3-beam search on a 96 KiB vmem cache with prefix
    sharing: the group is preempted (recompute) and comes back with prefix hits up to each
    beam's last token, so nothing of it is scheduled the step it is admitted. On main that step
    preempted it again as 'waiting for a sibling' (every member was in, decoding next), and
    the next step admitted it the same way: no token for ever (a server's clients timed out
    after 120 s, found by a chaos run). Now it decodes next step; beams as transformers'."""
    long = [(j * 37 + 11) % 256 for j in range(50)]
    params = BeamSearchParams(3, max_new_tokens=21, ignore_eos=True)
    with Engine(model("tiny-llama"), cache="vmem", layout="per-layer", page_bytes=4096,
                max_batch=8, max_context=128, cache_bytes=96 * 1024, preemption="recompute",
                prefix_sharing=True, check_integrity=True) as engine:
        sampled = engine.add_request([228, 158, 66], SamplingParams(
            max_new_tokens=30, ignore_eos=True, n=2, temperature=0.8, seed=7))
        rid = engine.add_beam_request(long, params)
        for _ in range(500):
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished(), "no progress"
        assert engine.scheduler.metrics.num_preemptions > 0
        beams, other = engine.output(rid, pop=True), engine.output(sampled, pop=True)
    assert other.status == "finished" and beams.status == "finished", beams.error
    assert not beam_mismatches([beams], reference("tiny-llama", [long], params, ()))
