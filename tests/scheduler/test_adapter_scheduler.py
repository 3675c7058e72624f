"""LoRA adapters in the scheduler (issue 31): admitted with their adapter (both or neither),
pinned exactly while a sequence of theirs runs, idle adapters evicted for KV before anything is
preempted, prefix keys rooted in the adapter's digest, refusals by name, the static split."""
import pytest

from vmemkv.scheduler.adapters import AdapterRef, AdapterStateError
from vmemkv.scheduler.errors import ConfigError, OutOfCapacityError, RequestTooLargeError
from vmemkv.scheduler.managers.base import EvictAdapter, LoadAdapter
from vmemkv.scheduler.managers.prefix import prefix_scope
from vmemkv.scheduler.request import Request, SeqState
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig

from .adapter_sched import POLICIES, TINY, digest, manager, ref, run, unit_bytes


# ---- AdapterRef and Request ------------------------------------------------------------------
def test_an_adapter_ref_is_validated_by_field():
    good = digest("x")
    assert AdapterRef("x", good.upper(), 1).digest == good        # lower-cased
    for args, field in ((("", good, 1), "name"), ((None, good, 1), "name"),
                        (("x", good[:63], 1), "digest"), (("x", "g" * 64, 1), "digest"),
                        (("x", 5, 1), "digest"), (("x", good, 0), "num_bytes"),
                        (("x", good, True), "num_bytes"), (("x", good, 1.5), "num_bytes")):
        with pytest.raises(ConfigError, match=f"AdapterRef.{field}"):
            AdapterRef(*args)
    with pytest.raises(ConfigError, match="Request.adapter must be an AdapterRef"):
        Request(0, 4, 4, adapter="x")


def test_the_prefix_scope_carries_the_digest_and_base_requests_keep_their_keys():
    a1, a2 = ref("a", "weights-1", 100), ref("a", "weights-2", 100)
    plain = Request(0, 4, 4, namespace="n", cache_salt="s")
    assert plain.prefix_scope == prefix_scope("n", "s")          # unchanged for the base model
    assert Request(0, 4, 4).prefix_scope is None
    scopes = [Request(0, 4, 4, adapter=a).prefix_scope for a in (a1, a2)]
    assert scopes[0] != scopes[1] and a1.digest in scopes[0] and a2.digest in scopes[1]
    assert not any('"a"' in s for s in scopes), "the name is not in the key"
    salted = Request(0, 4, 4, cache_salt="s", adapter=a1).prefix_scope
    assert salted not in scopes and salted != plain.prefix_scope


@pytest.mark.parametrize("policy,layout", POLICIES)
def test_same_name_other_weights_never_hits_and_same_digest_does(policy, layout):
    prompt = tuple(range(1, 33))
    first, other, same = ref("lora", "v1", 1000), ref("lora", "v2", 1000), ref("x", "v1", 1000)
    mgr = manager(policy, layout, tokens=256, prefix_eviction="lru")
    sched = Scheduler(mgr, SchedulerConfig(enable_prefix_sharing=True, check_every_step=True))
    hits = []
    for i, adapter in enumerate([first, other, same, None]):
        before = mgr.prefix_hits
        sched.add_request(Request(i, len(prompt), 2, prompt_token_ids=prompt, adapter=adapter))
        run(sched)
        hits.append(mgr.prefix_hits - before)
    assert hits[0] == 0
    assert hits[1] == 0, "a name reloaded with other weights hit the old KV"
    assert hits[2] > 0, "the same weights (digest) under another name share"
    assert hits[3] == 0, "the base model never shares an adapter's KV"


# ---- admission, pins, eviction before preemption --------------------------------------------
@pytest.mark.parametrize("policy,layout", POLICIES)
def test_an_idle_adapter_is_evicted_instead_of_preempting(policy, layout):
    mgr = manager(policy, layout, tokens=64)
    total = mgr.stats().total_tokens
    big = ref("big", "big", 24 * TINY.bytes_per_token)        # a third of the pool's bytes
    sched = Scheduler(mgr, SchedulerConfig(check_every_step=True))
    sched.add_request(Request(0, 4, 2, adapter=big))
    run(sched)
    assert mgr.adapter_stats().resident == 1 and mgr.adapter_stats().idle == 1
    assert mgr.adapter_uses(big) == 0
    # two base requests that together need every page: the idle adapter must go, no preemption
    sched.add_request(Request(1, 8, total // 2 - 8))
    sched.add_request(Request(2, 8, total // 2 - 8))
    run(sched)
    stats = mgr.adapter_stats()
    assert sched.metrics.num_preemptions == 0
    assert (stats.resident, stats.evictions, stats.loads) == (0, 1, 1)


@pytest.mark.parametrize("policy,layout", POLICIES)
def test_a_pinned_adapter_is_never_evicted_and_the_admission_sees_its_pages(policy, layout):
    mgr = manager(policy, layout, tokens=64)
    total, tokens_per_unit = mgr.stats().total_tokens, 64 // mgr.max_adapter_pages()
    adapter = ref("a", "a", 16 * TINY.bytes_per_token)      # a quarter of the pool
    mgr.acquire_adapter(adapter)
    assert mgr.can_allocate(total - 16) and not mgr.can_allocate(total - 16 + tokens_per_unit)
    # the watermark counts what is left beside the adapter
    assert mgr.can_allocate(8, reserve_tokens=total - 24)
    assert not mgr.can_allocate(8, reserve_tokens=total - 24 + tokens_per_unit)
    free_before = mgr.stats().free_tokens
    assert free_before == total - 16, "the free count includes the adapter's pages"
    mgr.allocate(0, total - 16)
    assert not mgr.can_append(0, 1) and mgr.adapter_stats().evictions == 0
    with pytest.raises(OutOfCapacityError):
        mgr.append(0, 16)
    mgr.release_adapter(adapter)
    assert mgr.can_append(0, 16)
    mgr.append(0, 16)
    assert mgr.adapter_stats().evictions == 1
    mgr.check_integrity()


@pytest.mark.parametrize("policy,layout", POLICIES)
def test_admission_takes_the_adapter_and_the_sequence_or_neither(policy, layout):
    mgr = manager(policy, layout, tokens=64)
    adapter = ref("a", "a", 40 * TINY.bytes_per_token)
    sched = Scheduler(mgr, SchedulerConfig(check_every_step=True))
    sched.add_request(Request(0, 8, 20))                       # runs: 28 tokens
    plan = sched.schedule()
    sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})
    sched.add_request(Request(1, 20, 4, adapter=adapter))      # fits alone, not beside seq 0
    plan = sched.schedule()
    assert [s.seq_id for s in plan.seqs] == [0]
    assert not any(type(op) is LoadAdapter for op in plan.ops), "loaded for nothing"
    assert mgr.adapter_stats().resident == 0
    sched.update({s.seq_id: 1 for s in plan.seqs if s.sample})
    run(sched)
    assert mgr.adapter_stats().loads == 1 and mgr.adapter_uses(adapter) == 0
    assert sched.state_of(1) is SeqState.FINISHED


@pytest.mark.parametrize("policy,layout", POLICIES)
def test_a_request_whose_adapter_can_never_fit_is_refused_by_name(policy, layout):
    mgr = manager(policy, layout, tokens=64)
    sched = Scheduler(mgr)
    huge = ref("huge-lora", "huge", 65 * TINY.bytes_per_token)
    with pytest.raises(RequestTooLargeError, match="adapter 'huge-lora'.*can never fit"):
        sched.add_request(Request(0, 4, 4, adapter=huge))
    half = ref("half-lora", "half", 40 * TINY.bytes_per_token)
    with pytest.raises(RequestTooLargeError, match="beside adapter 'half-lora'"):
        sched.add_request(Request(1, 20, 20, adapter=half))
    sched.add_request(Request(2, 10, 10, adapter=half))       # fits beside it
    assert [q.request.request_id for q in sched.waiting] == [2]
    run(sched)


@pytest.mark.parametrize("policy", ["reserve-max", "reserve-oracle"])
def test_reserve_policies_refuse_adapters_by_name(policy):
    mgr = manager(policy, tokens=128)
    adapter = ref("a", "a", 100)
    for call in (lambda: mgr.adapter_pages(100), lambda: mgr.acquire_adapter(adapter),
                 lambda: mgr.can_acquire_adapter(adapter), mgr.max_adapter_pages,
                 lambda: mgr.can_allocate(4, adapter=adapter)):
        with pytest.raises(ConfigError, match=f"policy '{policy}' cannot hold LoRA adapters"):
            call()
    with pytest.raises(ConfigError, match=f"policy '{policy}' cannot hold LoRA adapters"):
        Scheduler(mgr).add_request(Request(0, 4, 4, adapter=adapter))
    with pytest.raises(ConfigError, match="adapter_budget_bytes needs policy"):
        manager(policy, adapter_budget_bytes=4096)
    assert mgr.adapter_stats().resident == 0 and not mgr.evict_idle_adapter()


def test_release_more_often_than_acquired_is_refused():
    mgr = manager("paged")
    adapter = ref("a", "a", 100)
    with pytest.raises(AdapterStateError, match="released more often"):
        mgr.release_adapter(adapter)
    mgr.acquire_adapter(adapter)
    mgr.release_adapter(adapter)
    with pytest.raises(AdapterStateError, match="released more often"):
        mgr.release_adapter(adapter)
    with pytest.raises(AdapterStateError, match="another size"):
        mgr.acquire_adapter(AdapterRef("b", adapter.digest, 200))
    with pytest.raises(ConfigError, match="must be an AdapterRef"):
        mgr.acquire_adapter("a")


# ---- the static split --------------------------------------------------------------------------
@pytest.mark.parametrize("policy,layout", POLICIES)
def test_a_static_split_keeps_adapters_and_kv_apart(policy, layout):
    budget = 16 * TINY.bytes_per_token
    mgr = manager(policy, layout, tokens=64, adapter_budget_bytes=budget)
    shared = manager(policy, layout, tokens=64)
    assert mgr.stats().total_tokens == shared.stats().total_tokens - 16   # same bytes in all
    assert mgr.max_adapter_pages() == budget // unit_bytes(mgr)
    assert mgr.layout().adapter_pool_pages == budget // unit_bytes(mgr)
    small, other = ref("s", "s", budget // 2), ref("o", "o", budget // 2 + 1)
    mgr.acquire_adapter(small)
    load = mgr.take_ops()[-1]
    kv_units = mgr.pool_pages if policy == "vmem" else mgr.num_blocks
    assert type(load) is LoadAdapter and min(load.pool_pages) >= kv_units   # ids after KV's
    assert mgr.can_allocate(mgr.stats().total_tokens), "KV keeps all of its part"
    mgr.release_adapter(small)
    mgr.allocate(0, mgr.stats().total_tokens)
    assert mgr.adapter_stats().resident == 1, "KV never evicts a split's adapter"
    assert mgr.can_acquire_adapter(other)
    mgr.acquire_adapter(other)                     # the idle one goes for the other adapter
    ops = mgr.take_ops()
    assert [type(op) for op in ops][-2:] == [EvictAdapter, LoadAdapter]
    assert mgr.adapter_stats().resident == 1
    too_big = ref("t", "t", budget + 1)
    assert not mgr.can_acquire_adapter(too_big) and shared.can_acquire_adapter(too_big)
    with pytest.raises(RequestTooLargeError, match="adapter 't'.*can never fit"):
        Scheduler(mgr).add_request(Request(1, 4, 4, adapter=too_big))
    mgr.check_integrity()
    if policy == "vmem":
        with pytest.raises(ConfigError, match="cannot resize"):
            mgr.resize(mgr.cache_bytes)
        with pytest.raises(ConfigError, match="does not resize"):
            manager(policy, layout, tokens=64, adapter_budget_bytes=budget,
                    max_cache_bytes=128 * TINY.bytes_per_token)
    with pytest.raises(ConfigError, match="adapter_budget_bytes"):
        manager(policy, layout, tokens=64, adapter_budget_bytes=64 * TINY.bytes_per_token)
    with pytest.raises(ConfigError, match="adapter_budget_bytes=1 holds no"):
        manager(policy, layout, tokens=64, adapter_budget_bytes=1)


@pytest.mark.parametrize("layout", ["per-layer", "interleaved"])
def test_a_resize_evicts_idle_adapters_last_and_keeps_pinned_ones(layout):
    mgr = manager("vmem", layout, tokens=64)
    pinned, idle = ref("p", "p", 8 * TINY.bytes_per_token), ref("i", "i", 8 * TINY.bytes_per_token)
    mgr.acquire_adapter(pinned)
    mgr.acquire_adapter(idle)
    mgr.release_adapter(idle)
    mgr.take_ops()
    short = mgr.resize(0)
    ops = mgr.take_ops()
    assert [op.adapter_id for op in ops if type(op) is EvictAdapter] == [idle.digest]
    assert short == mgr.adapter_pages(pinned.num_bytes) * mgr.page_bytes
    mgr.release_adapter(pinned)
    assert mgr.resize(0) == 0 and mgr.adapter_stats().resident == 0
    mgr.check_integrity()


@pytest.mark.parametrize("policy,layout", POLICIES)
@pytest.mark.parametrize("split", [None, 16 * TINY.bytes_per_token])
def test_adapter_state_is_journaled_and_a_rollback_restores_it(policy, layout, split):
    mgr = manager(policy, layout, tokens=64, adapter_budget_bytes=split)
    a, b = ref("a", "a", 4 * TINY.bytes_per_token), ref("b", "b", 8 * TINY.bytes_per_token)
    mgr.acquire_adapter(a)
    mgr.acquire_adapter(b)
    mgr.release_adapter(a)
    assert mgr.journal_gaps() == []
    ledger = mgr.ledger if policy == "vmem" else mgr._ledger

    def snapshot():
        return (mgr.resident_adapters(), mgr.adapter_stats(), list(mgr._idle_adapters),
                ledger.tenants(), mgr._adapter_ledger.tenants(), mgr.stats(), list(mgr._ops))
    before = snapshot()
    mgr.begin()
    mgr.release_adapter(b)                   # idle after a: evicted second
    mgr.allocate(0, mgr.stats().total_tokens - (0 if split else 8))   # shared: evicts a, b
    mgr.acquire_adapter(ref("c", "c", (8 if split else 2) * TINY.bytes_per_token))
    assert mgr.adapter_stats().evictions >= 1
    mgr.check_integrity()
    mgr.rollback()
    assert snapshot() == before
    mgr.check_integrity()


@pytest.mark.parametrize("policy,layout", POLICIES)
def test_the_longest_sequence_beside_an_adapter(policy, layout):
    mgr = manager(policy, layout, tokens=64)
    # one unit taken: KV loses the slice (a page of every member) or block it belonged to
    per_slice = mgr.tokens_per_page if policy == "vmem" else mgr.block_size
    assert mgr.max_sequence_tokens_with_adapter(ref("a", "a", 1)) == 64 - per_slice
    assert mgr.max_sequence_tokens_with_adapter(ref("a", "a", 64 * TINY.bytes_per_token)) == 0
    assert mgr.adapter_pages(unit_bytes(mgr) + 1) == 2
    with pytest.raises(ConfigError, match="num_bytes"):
        mgr.adapter_pages(0)


@pytest.mark.parametrize("policy,layout", POLICIES)
def test_kv_cache_usage_counts_pinned_adapters_as_held_and_idle_ones_as_free(policy, layout):
    """Both layouts give the same gauge: a pinned adapter holds its share of a shared pool, an
    idle one is free (KV takes it when it needs it); in a static split adapters are not KV's."""
    adapter = ref("a", "a1", 16 * TINY.bytes_per_token)          # 1/8 of the 128-token cache
    mgr = manager(policy, layout, tokens=128)
    mgr.acquire_adapter(adapter)
    assert mgr.kv_cache_usage() == pytest.approx(1 / 8)
    mgr.release_adapter(adapter)
    assert mgr.adapter_stats().idle_pages and mgr.kv_cache_usage() == 0.0
    split = manager(policy, layout, tokens=128, adapter_budget_bytes=32 * TINY.bytes_per_token)
    split.acquire_adapter(adapter)
    assert split.kv_cache_usage() == 0.0
