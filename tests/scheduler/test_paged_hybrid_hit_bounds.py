"""What a paged hybrid's hit may cost and cover: cached blocks a hit revives were counted as
available, so reviving them takes that room (``can_allocate`` agrees with ``allocate``, and a
refusal changes nothing); a sample sharing a sibling's blocks (``share_from``) shares whole blocks
below its last token only, as a prompt's hit does (the last token's block is its own)."""
import pytest

from vmemkv.scheduler.errors import OutOfCapacityError

from .test_managers_state_machine import fingerprint
from .test_paged_hybrid_prefix import BS, PROMPT, manager


def test_a_hit_on_cached_blocks_takes_their_room_and_can_allocate_agrees():
    m = manager(blocks=12)               # 12 blocks over the full and the windowed group
    m.allocate(0, len(PROMPT), PROMPT)   # 22 tokens: 6 blocks in each group, all 12
    m.mark_computed(0, len(PROMPT))
    m.free(0)                            # 5 full blocks a group cached, the 2 partial ones free
    m.allocate(1, 6, list(range(500, 506)))    # 2 blocks a group: the 2 free + block 4 of each
    # the prompt now hits blocks 0..3 of the full group and the windowed group's blocks 2, 3
    # (its window of 6 before token 16): 6 cached blocks revived + 2 new in each group = 10,
    # and only the 8 cached blocks are available
    assert not m.can_allocate(len(PROMPT), PROMPT)
    before = fingerprint(m)
    with pytest.raises(OutOfCapacityError):
        m.allocate(2, len(PROMPT), PROMPT)
    assert fingerprint(m) == before
    m.free(1, computed_tokens=0)         # its 4 blocks free again: 12 available
    assert m.can_allocate(len(PROMPT), PROMPT)
    assert m.allocate(2, len(PROMPT), PROMPT) == 4 * BS
    m.check_integrity()


@pytest.mark.parametrize("tokens", [8, 9, 12])
def test_a_siblings_share_never_covers_the_samples_last_token(tokens):
    m = manager()
    ids = list(range(tokens))
    m.allocate(0, tokens, ids)
    m.mark_computed(0, tokens)
    hit = m.allocate(1, tokens, share_from=(0, tokens))
    assert hit == (tokens - 1) // BS * BS            # 8 -> 4, 9 -> 8, 12 -> 8
    full0, full1 = m.block_tables(0)[0], m.block_tables(1)[0]
    assert full1[:hit // BS] == full0[:hit // BS] and full1[hit // BS] != full0[hit // BS]
    m.check_integrity()
