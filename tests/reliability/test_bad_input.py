"""Every user-facing error listed in docs/errors.md: its type, a message that names the value and
the limit, and no state change. CLI errors exit 2 with one line on stderr and no traceback.

Each case is (id, setup, action, expected type, substrings of the message); ``setup`` builds the
objects, ``state`` of them is compared before and after the failing call.
"""
import os

import pytest
import torch

from vmemkv import vmem
from vmemkv.runtime.attention import get_backend
from vmemkv.runtime.attention.errors import UnknownBackendError, UnsupportedError
from vmemkv.runtime.attention.registry import fastest_backend
from vmemkv.runtime.kv import make_kv
from vmemkv.cli import main
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheConfigError, CacheStateError, CacheTooLargeError
from vmemkv.scheduler.cost import CostModel
from vmemkv.scheduler.errors import (ConfigError, DuplicateSequenceError, OutOfCapacityError, SlotError,
                              RequestTooLargeError, SwapSpaceExhaustedError, UnknownSequenceError)
from vmemkv.scheduler.managers import make_manager
from vmemkv.scheduler.managers.common import TransactionStateError
from vmemkv.scheduler.presets import get_device, get_model
from vmemkv.scheduler.request import Request
from vmemkv.scheduler.scheduler import Scheduler, SchedulerConfig
from vmemkv.scheduler.workload import WorkloadSpec
from vmemkv.vmem.faults import FaultInjectingDriver
from .. import process_resources
from vmemkv.vmem.host import HostDriver

from .model import canon, small_config

from .conftest import mem_total

PAGE = os.sysconf("SC_PAGE_SIZE")
MODEL = small_config().model_spec()


# ---- vmem --------------------------------------------------------------------------------
@pytest.fixture
def pool_range():
    driver = vmem.open_driver("host")
    pool = vmem.PagePool(driver, 4, PAGE)
    rng = vmem.VirtualRange(pool, 8 * PAGE)
    rng.map(0, pool.allocate(1)[0])
    yield driver, pool, rng
    rng.close()
    for page in range(pool.total_pages):
        if not pool.is_free(page):
            pool.release(page)
    pool.close()


def vmem_state(pool, rng):
    return (pool.free_pages, [pool.mapping_count(p) for p in range(pool.total_pages)],
            rng.mapped_pages())


VMEM_CASES = [
    ("map-index-out-of-range", lambda d, p, r: r.map(8, 1), vmem.PageIndexError, ["8", "0..7"]),
    ("map-twice", lambda d, p, r: r.map(0, r.page_at(0)), vmem.AlreadyMappedError, ["page index 0"]),
    ("unmap-unmapped", lambda d, p, r: r.unmap(3), vmem.NotMappedError, ["page index 3"]),
    ("map-free-page", lambda d, p, r: r.map(1, 3), vmem.PageStateError, ["page 3", "free"]),
    ("pool-exhausted", lambda d, p, r: p.allocate(9), vmem.PoolExhaustedError, ["9 pages", "3 of 4 free"]),
    ("release-mapped", lambda d, p, r: p.release(r.page_at(0)), vmem.PageStateError, ["still mapped"]),
    ("release-free", lambda d, p, r: p.release(2), vmem.PageStateError, ["page 2", "already free"]),
    ("page-id-range", lambda d, p, r: p.is_free(4), vmem.PageStateError, ["page id 4", "0..3"]),
    ("close-mapped-pool", lambda d, p, r: p.close(), vmem.PageStateError, ["1 page(s)", "still mapped"]),
    ("tensor-outside", lambda d, p, r: r.tensor(0, 9 * PAGE), vmem.PageIndexError,
     [str(9 * PAGE), str(8 * PAGE)]),
    ("tensor-misaligned", lambda d, p, r: r.tensor(2, 4, torch.float32), vmem.AlignmentError,
     ["offset 2", "element size 4"]),
    ("pool-bad-page-size", lambda d, p, r: vmem.PagePool(d, 1, PAGE + 1), vmem.AlignmentError,
     [str(PAGE + 1), str(PAGE)]),
    ("pool-no-pages", lambda d, p, r: vmem.PagePool(d, 0, PAGE), vmem.VMemConfigError, ["num_pages >= 1", "0"]),
    ("range-no-size", lambda d, p, r: vmem.VirtualRange(p, 0), vmem.VMemConfigError, ["size_bytes >= 1", "0"]),
    ("unknown-driver", lambda d, p, r: vmem.open_driver("tpu"), vmem.VMemConfigError, ["'tpu'", "'host'", "'cuda'"]),
    ("fault-kind", lambda d, p, r: FaultInjectingDriver(d).fail_at("mmap", 0), vmem.VMemConfigError,
     ["'mmap'", "map, unmap"]),
    ("reserve-too-much", lambda d, p, r: d.reserve(1 << 47), vmem.DriverCallError,
     [str(1 << 47), "reserve", "errno"]),
    ("reserve-past-address-space", lambda d, p, r: d.reserve(1 << 62), vmem.VMemConfigError,
     [str(1 << 62), "size_bytes", "128 TiB"]),
]


@pytest.mark.parametrize("action,error,words", [c[1:] for c in VMEM_CASES], ids=[c[0] for c in VMEM_CASES])
def test_vmem_error(pool_range, action, error, words):
    driver, pool, rng = pool_range
    before = vmem_state(pool, rng)
    with pytest.raises(error) as info:
        action(driver, pool, rng)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert vmem_state(pool, rng) == before
    pool.check_integrity()


def test_vmem_closed_error():
    driver = HostDriver()
    pool = vmem.PagePool(driver, 1, PAGE)
    pool.close()
    with pytest.raises(vmem.ClosedError, match="after close"):
        pool.allocate(1)


def test_cuda_driver_unavailable_names_the_reason():
    from vmemkv.vmem.cuda import cuda_unavailable_reason
    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("CUDA is available here")
    with pytest.raises(vmem.DriverUnavailableError) as info:
        vmem.open_driver("cuda")
    assert str(info.value)


# ---- scheduler ---------------------------------------------------------------------------
def vmem_manager():
    mgr = make_manager("vmem", MODEL, 3 * 32 * MODEL.bytes_per_token, 64, page_bytes=4096,
                       max_slots=2, swap_bytes=0)
    mgr.allocate(1, 40)
    return mgr


def paged_manager():
    mgr = make_manager("paged", MODEL, 8 * 8 * MODEL.bytes_per_token, 64, block_size_tokens=8,
                       swap_bytes=10 * MODEL.bytes_per_token)
    mgr.allocate(1, 40)
    return mgr


MANAGER_CASES = [
    ("allocate-too-long", vmem_manager, lambda m: m.allocate(2, 65), RequestTooLargeError,
     ["num_tokens=65", "64 tokens"]),
    ("append-past-max", paged_manager, lambda m: m.append(1, 25), RequestTooLargeError,
     ["65", "max_seq_len 64"]),
    ("allocate-duplicate", vmem_manager, lambda m: m.allocate(1, 5), DuplicateSequenceError, ["sequence 1"]),
    ("free-unknown", vmem_manager, lambda m: m.free(7), UnknownSequenceError, ["sequence 7"]),
    ("append-unknown", paged_manager, lambda m: m.append(7), UnknownSequenceError, ["sequence 7"]),
    ("no-room", vmem_manager, lambda m: m.allocate(2, 60), OutOfCapacityError,
     ["needs 2 page groups", "1 free", "reclaimable"]),
    ("no-slot", vmem_manager, lambda m: (m.allocate(2, 1), m.allocate(3, 1)), OutOfCapacityError,
     ["all 2 slots are in use"]),
    ("swap-space", paged_manager, lambda m: m.swap_out(1), SwapSpaceExhaustedError,
     [str(40 * MODEL.bytes_per_token), str(10 * MODEL.bytes_per_token)]),
    ("negative-append", paged_manager, lambda m: m.append(1, -1), ConfigError, ["num_tokens", ">= 0", "-1"]),
    ("ids-mismatch", paged_manager, lambda m: m.append(1, 2, token_ids=[1]), ConfigError,
     ["1 ids", "num_tokens=2"]),
    ("commit-without-begin", paged_manager, lambda m: m.commit(), TransactionStateError, ["without begin"]),
    ("slot-outside", vmem_manager, lambda m: m.allocate(2, 1, slot=2), SlotError,
     ["sequence 2", "slot 2", "0..1"]),
    ("slot-taken", vmem_manager, lambda m: m.allocate(2, 1, slot=m.slot_of(1)), SlotError,
     ["sequence 2", "holds sequence 1"]),
]


@pytest.mark.parametrize("make,action,error,words", [c[1:] for c in MANAGER_CASES],
                         ids=[c[0] for c in MANAGER_CASES])
def test_manager_error(make, action, error, words):
    mgr = make()
    if error is OutOfCapacityError and "slot" in words[0]:
        mgr.allocate(2, 1)
        action = (lambda m: m.allocate(3, 1))
    before = canon({k: v for k, v in vars(mgr).items() if k != "model"})
    with pytest.raises(error) as info:
        action(mgr)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert canon({k: v for k, v in vars(mgr).items() if k != "model"}) == before
    mgr.check_integrity()


CONFIG_CASES = [
    ("policy", lambda: make_manager("lru", MODEL, 10**6, 64), ["policy", "'lru'", "paged"]),
    ("cache-bytes", lambda: make_manager("paged", MODEL, 0, 64), ["cache_bytes", ">= 1", "0"]),
    ("layout", lambda: make_manager("vmem", MODEL, 10**6, 64, layout="diagonal"), ["layout", "'diagonal'"]),
    ("page-too-small", lambda: make_manager("vmem", MODEL, 10**6, 64, page_bytes=64),
     ["page_bytes=64", ">= 128"]),
    ("max-len-not-multiple", lambda: make_manager("vmem", MODEL, 10**6, 50, page_bytes=4096),
     ["max_seq_len_tokens=50", "tokens_per_page=32", "nearest valid: 32 or 64"]),
    ("cache-holds-no-group", lambda: make_manager("vmem", MODEL, 100, 64, page_bytes=4096),
     ["cache_bytes=100", "16384"]),
    ("reserve-too-small", lambda: make_manager("reserve-max", MODEL, 10 * MODEL.bytes_per_token, 64),
     ["holds 10 tokens", "max_seq_len_tokens=64"]),
    ("oracle-needs-final", lambda: make_manager("reserve-oracle", MODEL, 10**6, 64).allocate(1, 5),
     ["final_tokens"]),
    ("request-prompt", lambda: Request(0, prompt_len=0, max_tokens=1), ["prompt_len", ">= 1", "0"]),
    ("request-ids", lambda: Request(0, prompt_len=3, max_tokens=1, prompt_token_ids=(1,)),
     ["1 ids", "prompt_len is 3"]),
    ("scheduler-watermark", lambda: SchedulerConfig(watermark=1.5), ["watermark", "[0, 1)", "1.5"]),
    ("workload", lambda: WorkloadSpec(num_requests=0), ["num_requests", ">= 1", "0"]),
    ("cost", lambda: CostModel(get_model("tiny"), get_device("h100"), prefill_mfu=2.0),
     ["prefill_mfu", "(0, 1]", "2.0"]),
    ("model", lambda: get_model("gpt-9"), ["'gpt-9'", "llama-3-8b"]),
    ("device", lambda: get_device("tpu"), ["'tpu'", "h100"]),
]


@pytest.mark.parametrize("action,words", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_scheduler_config_error(action, words):
    with pytest.raises(ConfigError) as info:
        action()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_scheduler_rejects_a_request_longer_than_max_len_and_keeps_its_queues():
    mgr = make_manager("paged", MODEL, 10**6, 64, block_size_tokens=8)
    sched = Scheduler(mgr)
    sched.add_request(Request(1, prompt_len=10, max_tokens=5))
    before = (list(sched.waiting), dict(sched.seqs))
    with pytest.raises(RequestTooLargeError) as info:
        sched.add_request(Request(2, prompt_len=60, max_tokens=10))
    assert "60" in str(info.value) and "70 tokens" in str(info.value) and "64" in str(info.value)
    with pytest.raises(DuplicateSequenceError, match="request 1"):
        sched.add_request(Request(1, prompt_len=1, max_tokens=1))
    assert (list(sched.waiting), dict(sched.seqs)) == before


# ---- runtime -----------------------------------------------------------------------------
CACHE_CONFIG_CASES = [
    ("layers", dict(num_layers=0), ["CacheConfig.num_layers", "[1, 1024]", "0"]),
    ("batch", dict(max_batch=1 << 17), ["CacheConfig.max_batch", str(1 << 16), str(1 << 17)]),
    ("context-type", dict(max_context=64.0), ["CacheConfig.max_context", "64.0"]),
    ("dtype", dict(dtype="int8"), ["CacheConfig.dtype", "'int8'", "float16"]),
    ("device", dict(device="tpu"), ["CacheConfig.device", "'tpu'"]),
]


def _params(cases):
    return [pytest.param(*c.values[1:], id=c.values[0], marks=c.marks) if hasattr(c, "marks")
            else pytest.param(*c[1:], id=c[0]) for c in cases]


@pytest.mark.parametrize("fields,words", _params(CACHE_CONFIG_CASES))
def test_cache_config_error(fields, words):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=16)
    with pytest.raises(CacheConfigError) as info:
        CacheConfig(**{**base, **fields})
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_make_cache_errors():
    config = small_config()
    with pytest.raises(CacheConfigError, match="'vmem' or 'paged', got 'flat'"):
        make_kv(config, "flat")
    with pytest.raises(ConfigError, match="layout"):
        make_kv(config, "vmem", layout="diagonal")
    from vmemkv.runtime.kv import cache_for
    mgr = make_manager("vmem", MODEL, 10**6, 64, page_bytes=4096, max_slots=3)
    with pytest.raises(CacheConfigError, match="3 slots but CacheConfig.max_batch is 4"):
        cache_for(mgr, config)
    with pytest.raises(CacheConfigError, match="needs a 'vmem' or 'paged' memory manager, got 'reserve-max'"):
        cache_for(make_manager("reserve-max", MODEL, 10**6, 64), config)


@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_cache_state_errors_change_nothing(kind):
    config = small_config()
    cache = make_kv(config, kind, page_bytes=4096) if kind == "vmem" else make_kv(config, kind)
    mgr = cache.manager
    mgr.allocate(1, 10)
    cache.execute(mgr.take_ops())
    cases = [
        (lambda: cache.begin_step([(1, 8, 5)]), ["up to 13", "holds 10"]),
        (lambda: cache.begin_step([(1, 0, 5), (1, 5, 5)]), ["twice", "[1, 1]"]),
        (lambda: cache.begin_step([(1, 0, 0)]), ["num_new_tokens >= 1", "0"]),
        (lambda: cache.read(1, 0, 11), ["holds 10", "read 11"]),
        (lambda: cache.write(0, None, None), ["no step begun"]),
        (lambda: cache.execute(["bogus"]), ["cannot execute op 0", "'bogus'"]),
    ]
    for action, words in cases:
        with pytest.raises(CacheStateError) as info:
            action()
        for word in words:
            assert word in str(info.value), (word, str(info.value))
        cache.check_integrity()
    with pytest.raises(UnknownSequenceError, match="sequence 5"):
        cache.begin_step([(5, 0, 1)])
    cache.close()
    if kind == "vmem":
        with pytest.raises(CacheStateError, match="after close"):
            cache.execute([])


def test_attention_backend_errors():
    with pytest.raises(UnknownBackendError) as info:
        get_backend("flash9")
    assert "'flash9'" in str(info.value) and "sdpa" in str(info.value)
    with pytest.raises(UnsupportedError, match="'banded'"):
        fastest_backend("banded", "cpu")


# ---- CLI ---------------------------------------------------------------------------------
CLI_CASES = [
    ["simulate", "--cache-gb", "0"],
    ["simulate", "--policy", "lru"],
    ["simulate", "--requests", "0"],
    ["simulate", "--watermark", "2"],
    ["simulate", "--page-size", "3x"],
    ["simulate", "--trace", "/nonexistent/trace.jsonl"],
    ["simulate", "--max-len", "1"],
    ["info", "--bogus"],
    ["frobnicate"],
    [],
]


@pytest.mark.parametrize("argv", CLI_CASES, ids=[" ".join(a) or "no-command" for a in CLI_CASES])
def test_cli_error_is_one_line_exit_2(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and "error" in err and "Traceback" not in err, err
    assert out == ""


# ---- resource bounds ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_a_cache_larger_than_the_host_is_refused_up_front(kind):
    # huge pages / blocks keep the manager's tables small for a many-GiB cache
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=1, max_context=1 << 19)
    too_big = 2 * mem_total()
    driver = FaultInjectingDriver(HostDriver())
    with process_resources.watch() as watch:
        before = watch.snapshot()
        with pytest.raises(CacheTooLargeError) as info:
            if kind == "vmem":
                make_kv(config, "vmem", cache_bytes=too_big, page_bytes=1 << 26, driver=driver)
            else:
                make_kv(config, "paged", cache_bytes=too_big, block_size=1 << 16)
        assert watch.snapshot() == before and not watch.reserved
    message = str(info.value)
    assert str(mem_total()) in message and "MemTotal" in message and "bytes" in message
    assert driver.calls["create_pages"] == 0 and driver.calls["reserve"] == 0   # nothing tried


def test_more_requests_than_slots_wait_instead_of_failing():
    mgr = make_manager("vmem", MODEL, 10**6, 64, page_bytes=4096, max_slots=2)
    sched = Scheduler(mgr)
    for request_id in range(6):
        sched.add_request(Request(request_id, prompt_len=5, max_tokens=3))
    most, finished = 0, 0
    for _ in range(50):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        most = max(most, len(plan.seqs))
        mgr.check_integrity()
        finished += len(sched.update({s.seq_id: 1 for s in plan.seqs if s.sample}))
    assert most == 2 and finished == 6     # two at a time, all served, nothing raised
    mgr.allocate(100, 5)
    mgr.allocate(101, 5)
    assert not mgr.can_allocate(5)
    with pytest.raises(OutOfCapacityError, match="all 2 slots are in use"):
        mgr.allocate(102, 5)
