"""Block-granular prefix hits on the vmem manager (issue 28): what a hit shares, what it copies,
what the copies cost, and that a colliding digest is a miss."""
import hashlib

from vmemkv.scheduler.managers import CopyExtent, MapExtent, make_manager
from vmemkv.scheduler.managers.blocks import BlockIndex
from vmemkv.scheduler.presets import ModelSpec

# 2 layers, one KV head of 8 fp16 dims: 16 bytes a layer-token; 1 KiB pages hold 64 tokens
MODEL = ModelSpec("t", 2, 1, 8, 2, 0)


def manager(block_tokens=16, **options):
    return make_manager("vmem", MODEL, 64 * 1024, 512, page_bytes=1024,
                        prefix_block_tokens=block_tokens, **options)


SYSTEM = list(range(1000, 1040))          # 40 tokens: two whole blocks of 16


def test_a_hit_shorter_than_a_page_is_copied_into_the_new_sequences_own_page():
    m = manager()
    a = SYSTEM + list(range(100))          # 140 tokens: pages 0, 1, 2
    m.allocate(0, len(a), a)
    m.mark_computed(0, len(a))
    m.take_ops()
    b = SYSTEM + list(range(500, 530))
    assert m.allocate(1, len(b), b) == 32              # 2 blocks, never a whole page
    ops = m.take_ops()
    copies = [op for op in ops if isinstance(op, CopyExtent)]
    assert copies == [CopyExtent(0, 0, 1, 0, "full", num_tokens=32)]
    src, dst = m.mapped_pages(0)[0], m.mapped_pages(1)[0]
    assert src != dst and m._refs[dst] == 1            # its own page: the source stays A's
    assert m.copied_bytes(ops) == 32 * 2 * 2 * 16      # tokens x layers x K,V x bytes
    assert (m.prefix_hits, m.block_hit_tokens) == (32, 32)
    m.check_integrity()


def test_whole_pages_are_shared_and_only_the_rest_is_copied():
    m = manager()
    a = list(range(200))                                # pages 0..3 (64 tokens each)
    m.allocate(0, len(a), a)
    m.mark_computed(0, len(a))
    first_page = m._seq(0).units[0]
    m.free(0)
    m.take_ops()
    b = a[:100] + [7]
    assert m.allocate(1, len(b), b) == 64 + 32          # page 0 shared, 2 blocks of page 1 copied
    ops = m.take_ops()
    assert [op.num_tokens for op in ops if isinstance(op, CopyExtent)] == [32]
    assert m._seq(1).units[0] == first_page             # the same physical pages
    m.check_integrity()


def test_a_cached_partial_page_survives_its_slots_reuse_and_is_mapped_for_the_copy():
    m = manager()
    a = SYSTEM + [1, 2, 3]
    m.allocate(0, len(a), a, slot=0)
    m.mark_computed(0, len(a))
    m.free(0)                                           # page 0 (43 tokens) cached: blocks
    m.allocate(1, 10, list(range(10)), slot=0)          # slot 0 reused: the page is unmapped
    m.take_ops()
    c = SYSTEM + [9]
    assert m.allocate(2, len(c), c, slot=1) == 32
    ops = m.take_ops()
    temp = [op for op in ops if isinstance(op, MapExtent) and op.slot == 1 and op.page_index > 0]
    assert len(temp) == 1                               # mapped at an unused page index...
    copy = next(op for op in ops if isinstance(op, CopyExtent))
    assert (copy.src_slot, copy.src_page_index, copy.num_tokens) == (1, temp[0].page_index, 32)
    assert ops[-1].page_index == temp[0].page_index     # ...and unmapped after the copy
    m.check_integrity()


def test_no_block_hits_when_turned_off_or_with_eviction_off():
    for m in (manager(block_tokens=0), manager(prefix_eviction="off")):
        a = SYSTEM + [1]
        m.allocate(0, len(a), a)
        m.mark_computed(0, len(a))
        m.free(0)
        assert m.allocate(1, len(a), a) == 0
        m.check_integrity()


def test_a_colliding_digest_is_a_miss():
    index = BlockIndex(2)
    parent = hashlib.sha256(b"root").digest()
    tokens = bytes(range(32))                           # two blocks of 2 int64 ids
    index.publish(5, parent, tokens)
    assert index.match(parent, tokens, 2) == ((5,), 2)
    forged = index.by_group[5]
    index.by_group[5] = forged._replace(tokens=bytes(32))   # same digests, other ids
    assert index.match(parent, tokens, 2) == ((), 0)
    index.by_group[5] = forged._replace(parent=hashlib.sha256(b"other").digest())
    assert index.match(parent, tokens, 2) == ((), 0)        # same digests and ids, other prefix
    index.by_group[5] = forged
    assert index.match(hashlib.sha256(b"other").digest(), tokens, 2) == ((), 0)
    index.drop(5)
    assert not index.by_digest and not index.by_group


def test_the_simulator_charges_copies_at_the_copy_bandwidth():
    from vmemkv.scheduler.simulator import SimConfig, simulate
    base = dict(policy="vmem", cache_bytes=20 * 10**9, page_bytes=2 * 2**20, max_seq_len=8192)
    from vmemkv.scheduler.traces import load_trace
    trace = [e for e in load_trace("mooncake-conversation")[:100]    # prompt blocks by hash id
             if e.prompt_len + e.output_len <= 8192][:40]
    fast = simulate(trace, SimConfig(**base))
    slow = simulate(trace, SimConfig(**base, copy_bytes_per_s=1e9))
    whole = simulate(trace, SimConfig(**base, prefix_block_tokens=0))
    assert fast.copied_kv_bytes == slow.copied_kv_bytes > 0 == whole.copied_kv_bytes
    assert fast.prefix_cache_hits > whole.prefix_cache_hits
    assert slow.simulated_seconds > fast.simulated_seconds


def _cached(m, seq_id, ids, slot):
    m.allocate(seq_id, len(ids), ids, slot=slot)
    m.mark_computed(seq_id, len(ids))
    m.free(seq_id)


def test_a_prompt_filling_its_slot_maps_the_source_under_another_free_slot_for_the_copy():
    """One page a slot (max_seq_len = the page): no page index of its own is left for an
    unmapped source, so the copy reads it through page 0 of another free slot."""
    m = make_manager("vmem", MODEL, 8 * 4 * 1024, 64, page_bytes=1024, max_slots=3,
                     prefix_block_tokens=16)
    assert m.pages_per_slot == 1
    _cached(m, 0, SYSTEM + [1, 2, 3], slot=0)
    m.allocate(1, 10, list(range(10)), slot=0)          # slot 0 reused: the source unmapped
    m.take_ops()
    c = SYSTEM + [9]
    assert m.allocate(2, len(c), c, slot=1) == 32
    ops = m.take_ops()
    copy = next(op for op in ops if isinstance(op, CopyExtent))
    assert (copy.src_slot, copy.src_page_index, copy.dst_slot) == (2, 0, 1)
    assert [type(op).__name__ for op in ops if getattr(op, "slot", None) == 2] == [
        "MapExtent", "UnmapExtent"]                     # mapped for the copy, then unmapped
    m.check_integrity()


def test_with_no_free_slot_left_the_source_is_mapped_past_a_running_sequence():
    m = make_manager("vmem", MODEL, 8 * 4 * 1024, 128, page_bytes=1024, max_slots=2,
                     prefix_block_tokens=16)
    assert m.pages_per_slot == 2
    _cached(m, 0, SYSTEM + [1, 2, 3], slot=0)
    m.allocate(1, 10, list(range(10)), slot=0)          # runs on slot 0, page 1 unused
    m.take_ops()
    c = SYSTEM + list(range(100))                       # 140 tokens fill both pages of slot 1
    assert m.allocate(2, 128, c[:128], slot=1) == 32
    copy = next(op for op in m.take_ops() if isinstance(op, CopyExtent))
    assert (copy.src_slot, copy.src_page_index, copy.dst_slot, copy.dst_page_index) == (0, 1, 1, 0)
    m.check_integrity()


def test_no_copy_is_offered_where_no_page_index_is_left_anywhere():
    m = make_manager("vmem", MODEL, 8 * 4 * 1024, 64, page_bytes=1024, max_slots=2,
                     prefix_block_tokens=16)
    _cached(m, 0, SYSTEM + [1, 2, 3], slot=0)
    m.allocate(1, 10, list(range(10)), slot=0)          # the only other slot, its one page used
    m.take_ops()
    c = SYSTEM + [9]
    assert m.allocate(2, len(c), c, slot=1) == 0        # a miss, not a write over someone's page
    assert not [op for op in m.take_ops() if isinstance(op, CopyExtent)]
    m.check_integrity()
