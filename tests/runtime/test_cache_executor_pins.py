"""Pins of the cache executors (runtime/cache): each test names a promise of a docstring that a
one-line slip in base.py, journal.py, paged_cache.py or adapters.py would break without any other
test noticing (found by a mutation audit). Caches are built directly and driven with hand-written
ops, so every byte moved is known."""
from __future__ import annotations

import weakref

import pytest
import torch

from vmemkv.runtime import memory
from vmemkv.runtime.cache import PagedKVCache
from vmemkv.runtime.cache.journal import PlanJournal
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError, CacheTooLargeError, PlanExecutionError
from vmemkv.scheduler.plan import EditBlocks, LoadAdapter, SwapIn, SwapOut

CONFIG = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2, max_context=64)
BLOCK_TOKENS = 4


def numbered_paged(num_blocks: int = 8) -> PagedKVCache:
    """A paged cache whose every stored number differs (so a wrong byte moved shows)."""
    cache = PagedKVCache(CONFIG, block_size=BLOCK_TOKENS, num_blocks=num_blocks)
    cache.pools.copy_(torch.arange(cache.pools.numel(), dtype=torch.float32)
                      .reshape(cache.pools.shape))
    return cache


def test_a_paged_pool_is_checked_at_its_full_size_before_it_is_allocated(monkeypatch):
    """8 blocks of 4 tokens of 512 bytes (2 layers): 16384 bytes, refused by name with 16383
    available; with block groups of one layer the shared pool holds half of that."""
    monkeypatch.setattr(memory, "promised_bytes", lambda device, excluding=None: 0)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 16383)
    with pytest.raises(CacheTooLargeError, match="pool of 8 blocks of 4 tokens needs 16384 bytes"):
        PagedKVCache(CONFIG, block_size=BLOCK_TOKENS, num_blocks=8)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 8191)
    with pytest.raises(CacheTooLargeError, match="needs 8192 bytes"):
        PagedKVCache(CONFIG, block_size=BLOCK_TOKENS, num_blocks=8, block_groups=((0,), (1,)))


def test_a_step_giving_a_sequence_no_new_token_is_refused_by_name():
    cache = numbered_paged()
    cache.apply_tables([EditBlocks(0, 0, (1,))])
    with pytest.raises(CacheStateError, match="num_new_tokens >= 1"):
        cache.begin_step([(0, 2, 0)])


def test_a_table_edit_naming_the_block_one_past_the_pool_is_refused():
    cache = numbered_paged(num_blocks=8)
    cache.apply_tables([EditBlocks(0, 0, (7,))])       # the last block is fine
    with pytest.raises(CacheStateError, match=r"names blocks \[8\] outside 0..7"):
        cache.apply_tables([EditBlocks(0, 1, (8,))])
    assert cache.block_table(0) == [7]


def test_reading_one_token_past_the_held_blocks_is_refused_by_name():
    cache = numbered_paged()
    cache.apply_tables([EditBlocks(0, 0, (3, 5))])
    k, _ = cache.read(0, 1, 2 * BLOCK_TOKENS)          # every held token reads
    assert torch.equal(k[BLOCK_TOKENS], cache.pools[1, 0, 5, 0])
    with pytest.raises(CacheStateError, match="holds 8 tokens, asked to read 9"):
        cache.read(0, 1, 2 * BLOCK_TOKENS + 1)


def test_a_plan_refused_while_binding_leaves_the_swap_space_as_before():
    cache = numbered_paged()
    cache.execute([SwapOut(7, 3, blocks=(2,))])
    before = cache.swap_buffer(7).clone()
    with pytest.raises(CacheStateError, match="sequence 9 has no swapped-out data"):
        cache.execute([SwapOut(5, 4, blocks=(0,)), SwapIn(7, 3, blocks=(4,)),
                       SwapIn(9, 4, blocks=(1,))])
    assert cache.swapped_tokens() == {7: 3}
    assert torch.equal(cache.swap_buffer(7), before)


def test_a_swap_in_of_fewer_tokens_than_were_swapped_out_is_refused():
    cache = numbered_paged()
    cache.execute([SwapOut(7, 8, blocks=(2, 3))])
    with pytest.raises(CacheStateError, match="swapping in 4 tokens but 8 were swapped out"):
        cache.execute([SwapIn(7, 4, blocks=(5,))])
    assert cache.swapped_tokens() == {7: 8}


def test_a_plans_swap_outs_are_checked_together_against_host_memory(monkeypatch):
    """Two swap-outs that fit the host one at a time but not together: the plan is refused at
    the second, naming both sizes, and nothing is swapped."""
    cache = numbered_paged()
    one = 2 * 2 * 4 * 2 * 16 * 4          # [layers, K/V, 4 tokens, kv_heads, head_dim] fp32
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: one + one // 2)
    monkeypatch.setattr(memory, "promised_bytes", lambda device, excluding=None: 0)
    cache.execute([SwapOut(1, 4, blocks=(0,))])         # one fits
    with pytest.raises(PlanExecutionError, match=f"beside {one} bytes") as info:
        cache.execute([SwapOut(2, 4, blocks=(2,)), SwapOut(3, 4, blocks=(4,))])
    assert info.value.op_index == 1 and isinstance(info.value.__cause__, CacheTooLargeError)
    assert cache.swapped_tokens() == {1: 4}


class SwapSpaceOwner:
    """An engine stand-in that promised ``promised`` host bytes: its swap space, unfilled."""

    def __init__(self, promised: int) -> None:
        self.promised = promised

    def promised_bytes(self, device) -> int:
        return self.promised if torch.device(device).type == "cpu" else 0


def test_a_swap_out_fills_its_owners_promise_instead_of_being_refused_by_it(monkeypatch):
    """runtime/memory.py: a swap-out's check leaves out its own owner's promise (the swap space
    it fills), and counts every other owner's."""
    one = 2 * 2 * 4 * 2 * 16 * 4
    cache = numbered_paged()
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 2 * one)
    monkeypatch.setattr(memory, "_promisers", weakref.WeakSet())
    owner, other = SwapSpaceOwner(4 * one), SwapSpaceOwner(0)
    memory.track_promises(owner)
    memory.track_promises(other)
    cache.swap_promised_by(owner)
    cache.execute([SwapOut(1, 4, blocks=(0,))])          # within its owner's promise
    other.promised = 2 * one
    with pytest.raises(PlanExecutionError, match="swapping out sequence 2"):
        cache.execute([SwapOut(2, 4, blocks=(2,))])      # another owner's promise counts
    assert cache.swapped_tokens() == {1: 4}


def test_an_undo_action_that_fails_does_not_stop_the_older_ones():
    """PlanJournal.undo runs every action newest first and returns the first error raised."""
    journal, ran = PlanJournal({}), []

    def failing(name):
        def undo():
            ran.append(name)
            raise RuntimeError(name)
        return undo
    journal.add(lambda: ran.append("oldest"))
    journal.add(failing("older"))
    journal.add(failing("newest"))
    error = journal.undo()
    assert ran == ["newest", "older", "oldest"]
    assert str(error) == "newest" and len(journal) == 0
    assert journal.undo() is None          # idempotent: nothing left to undo


def test_a_hybrid_swap_moves_each_layer_through_its_own_groups_blocks():
    """Block groups (one layer each, one shared pool): a swap op's blocks are every group's
    table, group after group; swapped out and back into other blocks, each layer reads exactly
    the tokens it had, and no block outside the plan changes."""
    cache = PagedKVCache(CONFIG, block_size=BLOCK_TOKENS, num_blocks=8, block_groups=((0,), (1,)))
    cache.pools.copy_(torch.arange(cache.pools.numel(), dtype=torch.float32)
                      .reshape(cache.pools.shape))
    cache.apply_tables([EditBlocks(0, 0, (1, 2), group=0), EditBlocks(0, 0, (5, 6), group=1)])
    before = [cache.read(0, layer, 8) for layer in range(2)]
    pools_before = cache.pools.clone()
    cache.execute([SwapOut(0, 8, blocks=(1, 2, 5, 6))])
    cache.execute([SwapIn(0, 8, blocks=(3, 4, 0, 7))])
    cache.apply_tables([EditBlocks(0, 0, (3, 4), group=0), EditBlocks(0, 0, (0, 7), group=1)])
    for layer in range(2):
        assert all(torch.equal(a, b) for a, b in zip(cache.read(0, layer, 8), before[layer]))
    assert torch.equal(cache.pools[:, :, [1, 2, 5, 6]], pools_before[:, :, [1, 2, 5, 6]])


def test_a_hybrid_write_stores_each_layers_keys_and_values_in_its_groups_blocks():
    cache = PagedKVCache(CONFIG, block_size=BLOCK_TOKENS, num_blocks=8, block_groups=((0,), (1,)))
    cache.apply_tables([EditBlocks(0, 0, (1,), group=0), EditBlocks(0, 0, (6,), group=1)])
    cache.begin_step([(0, 0, 3)])
    new = {layer: (torch.full((3, 2, 16), 10.0 + layer), torch.full((3, 2, 16), 20.0 + layer))
           for layer in range(2)}
    for layer, (k, v) in new.items():
        cache.write(layer, k, v)
    for layer, (k, v) in new.items():
        got_k, got_v = cache.read(0, layer, 3)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), layer


def test_an_adapter_load_must_name_exactly_the_units_its_bytes_take_inside_the_pool():
    """adapters.py: a LoadAdapter of n bytes names ceil(n / unit) distinct units of
    0..units-1; anything else is refused with the replica unchanged."""
    cache = numbered_paged(num_blocks=8)
    unit = cache._adapter_unit_bytes
    for op, words in ((LoadAdapter("a" * 64, (2, 3), unit), "take 1 units"),
                      (LoadAdapter("a" * 64, (8,), 10), "distinct units of 0..7")):
        with pytest.raises(CacheStateError, match=words):
            cache.execute([op])
        assert cache.resident_adapters() == {}
    cache.execute([LoadAdapter("a" * 64, (7, 2), unit + 1)])
    assert cache.resident_adapters() == {"a" * 64: ((7, 2), unit + 1)}
    assert cache.adapter_buffer("a" * 64).shape == (unit + 1,)


def test_a_steps_host_tables_are_the_block_table_entries_each_sequence_uses():
    """StepMeta.host_tables (what the flash backend reads instead of the device tables): per
    sequence, its first ceil(context / block_size) blocks, the same as the device table's."""
    cache = numbered_paged()
    cache.apply_tables([EditBlocks(0, 0, (3, 5, 6)), EditBlocks(1, 0, (1, 2, 4))])
    cache.begin_step([(0, 4, 1), (1, 6, 2)])             # contexts 5 and 8
    view = cache.layer_view(1)
    assert view.meta.host_tables == ((3, 5), (1, 2))
    device = [row[:view.num_blocks_of(i)] for i, row in enumerate(view.block_tables.tolist())]
    assert [list(t) for t in view.meta.host_tables] == device

