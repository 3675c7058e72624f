"""Every user-triggerable failure raises its typed error, names the value and the limit, and
leaves the manager exactly as it was."""
import pytest

from vmemkv.scheduler.errors import (ConfigError, DuplicateSequenceError, OutOfCapacityError,
                              RequestTooLargeError, SwapSpaceExhaustedError, UnknownSequenceError)
from vmemkv.scheduler.managers import POLICIES, make_manager
from vmemkv.scheduler.presets import ModelSpec

from .test_managers_state_machine import fingerprint

TINY = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)   # 2 bytes per token


def _manager(policy, tokens=32, max_len=16, swap_tokens=4):
    """``tokens`` of cache, blocks/pages of 4 tokens, four slots; sequences 0 (5 tokens) and
    1 (swapped out, 3 tokens) held."""
    m = make_manager(policy, TINY, 2 * tokens, max_len, block_size_tokens=4, page_bytes=4,
                     max_slots=4, swap_bytes=2 * swap_tokens)
    m.allocate(0, 5, final_tokens=8)
    m.allocate(1, 3, final_tokens=3)
    m.swap_out(1)
    m.take_ops()
    return m


def _unchanged(m, error, match, call, *args, **kw):
    before = fingerprint(m)
    with pytest.raises(error, match=match):
        call(*args, **kw)
    assert fingerprint(m) == before
    m.check_integrity()


@pytest.mark.parametrize("policy", POLICIES)
def test_unknown_sequence_leaves_state_unchanged(policy):
    m = _manager(policy)
    for call, args in [(m.append, (7,)), (m.can_append, (7,)), (m.fork, (7, 8)), (m.free, (7,)),
                       (m.swap_out, (7,)), (m.num_tokens, (7,)), (m.can_fork, (7,)),
                       (m.swap_in, (0,)), (m.append, (1,)), (m.swap_out, (1,))]:
        _unchanged(m, UnknownSequenceError, r"sequence \d", call, *args)


@pytest.mark.parametrize("policy", POLICIES)
def test_freeing_twice_is_an_unknown_sequence(policy):
    m = _manager(policy)
    m.free(0)
    m.free(1)                       # a swapped sequence can be dropped too
    _unchanged(m, UnknownSequenceError, "unknown sequence 0", m.free, 0)
    _unchanged(m, UnknownSequenceError, "unknown sequence 1", m.free, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_duplicate_sequence_leaves_state_unchanged(policy):
    m = _manager(policy)
    _unchanged(m, DuplicateSequenceError, "sequence 0", m.allocate, 0, 1, final_tokens=1)
    _unchanged(m, DuplicateSequenceError, "sequence 1", m.allocate, 1, 1, final_tokens=1)
    _unchanged(m, DuplicateSequenceError, "sequence 1", m.fork, 0, 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_request_too_large_names_length_and_limit(policy):
    m = _manager(policy)
    _unchanged(m, RequestTooLargeError, "17.*16", m.allocate, 5, 17, final_tokens=17)
    m.append(0, 3)                  # 8 tokens
    if policy == "reserve-oracle":  # its limit is the final length it was given
        _unchanged(m, OutOfCapacityError, "reservation of 8", m.append, 0, 1)
    else:
        m.append(0, 8)
        assert not m.can_append(0)
        _unchanged(m, RequestTooLargeError, "17 tokens, over max_seq_len 16", m.append, 0, 1)


@pytest.mark.parametrize("policy", ["paged", "vmem", "reserve-oracle"])
def test_request_larger_than_the_cache_is_too_large(policy):
    m = make_manager(policy, TINY, 2 * 8, 16, block_size_tokens=4, page_bytes=4)
    assert m.max_sequence_tokens == 8 and not m.can_allocate(9, final_tokens=9)
    _unchanged(m, RequestTooLargeError, "9 exceeds.* 8 tokens", m.allocate, 0, 9, final_tokens=9)


@pytest.mark.parametrize("policy", POLICIES)
def test_out_of_capacity_leaves_state_unchanged(policy):
    m = _manager(policy)
    m.allocate(2, 16, final_tokens=16)   # reserve-max: both reservations of 16 now used
    m.take_ops()
    free = m.stats().free_tokens
    n = 16 if policy == "reserve-max" else free + 4
    if policy != "reserve-max":
        m.allocate(3, free, final_tokens=free)
        m.take_ops()
        n = 4
    assert not m.can_allocate(n, final_tokens=n)
    _unchanged(m, OutOfCapacityError, "free|slots", m.allocate, 9, n, final_tokens=n)
    if policy in ("paged", "vmem"):
        assert not m.can_append(3, 1)
        _unchanged(m, OutOfCapacityError, "free|reclaimable", m.append, 3, 1)
    if policy == "vmem":            # fork needs a free slot, not pages: take the last one
        m.allocate(10, 0)
    if policy != "paged":
        assert not m.can_fork(0)
        _unchanged(m, OutOfCapacityError, "free|slots", m.fork, 0, 9)


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_space_exhausted_names_bytes_needed_and_free(policy):
    m = _manager(policy)            # 4 tokens of swap, 3 used by sequence 1
    assert not m.can_swap_out(0)
    _unchanged(m, SwapSpaceExhaustedError, "needs 10 bytes.* 2 of 8 free", m.swap_out, 0)


@pytest.mark.parametrize("policy", POLICIES)
def test_swap_in_without_room_leaves_state_unchanged(policy):
    m = make_manager(policy, TINY, 2 * 16, 16, block_size_tokens=4, page_bytes=4, max_slots=1,
                     swap_bytes=2 * 16)
    m.allocate(0, 8, final_tokens=8)
    m.swap_out(0)
    m.allocate(1, 16, final_tokens=16)
    m.take_ops()
    assert not m.can_swap_in(0)
    _unchanged(m, OutOfCapacityError, "swapping in sequence 0", m.swap_in, 0)


def test_reserve_oracle_needs_final_tokens():
    m = _manager("reserve-oracle")
    with pytest.raises(ConfigError, match="final_tokens"):
        m.can_allocate(4)
    _unchanged(m, ConfigError, "final_tokens", m.allocate, 4, 4)
    _unchanged(m, ConfigError, "final_tokens=2 is below num_tokens=4", m.allocate, 4, 4,
               final_tokens=2)


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_arguments_are_config_errors(policy):
    m = _manager(policy)
    _unchanged(m, ConfigError, "num_tokens", m.allocate, 4, -1, final_tokens=1)
    if policy in ("paged", "vmem"):
        _unchanged(m, ConfigError, "token_ids has 2 ids for num_tokens=1", m.append, 0, 1, [1, 2])


def test_a_vmem_pool_whose_max_cache_bytes_is_one_byte_below_cache_bytes_is_refused():
    with pytest.raises(ConfigError, match="max_cache_bytes=63 is below cache_bytes=64"):
        make_manager("vmem", TINY, 64, 16, page_bytes=4, max_slots=4, max_cache_bytes=63)
    m = make_manager("vmem", TINY, 64, 16, page_bytes=4, max_slots=4, max_cache_bytes=64)
    assert m.stats().total_tokens == 32         # the same size: accepted, nothing to grow into


def test_reserve_oracle_refuses_a_final_length_one_token_short_and_takes_an_exact_one():
    m = _manager("reserve-oracle")
    _unchanged(m, ConfigError, "final_tokens=3 is below num_tokens=4", m.allocate, 4, 4,
               final_tokens=3)
    m.allocate(4, 4, final_tokens=4)
    assert m.num_tokens(4) == 4
    m.check_integrity()
