"""What the unreachable-unit tests of vmem and paged share (test_vmem_unreachable_pages.py,
test_paged_unreachable_blocks.py): the models, and two requests that compute one unit at once,
the second then chaining a unit of its own on the first's copy. Units are 4 tokens (a paged
block, a vmem page of 1-byte token-layers)."""
from __future__ import annotations

from vmemkv.scheduler.presets import ModelSpec

WINDOW = 8
GEMMA3_LIKE = ModelSpec("g3", 6, 1, 1, 1, weight_bytes=0,
                        layer_windows=(WINDOW,) * 5 + (None,))   # 5 windowed : 1 full
FULL_ONLY = ModelSpec("llama", 6, 1, 1, 1, weight_bytes=0)
SHARED_UNIT = list(range(100, 104))              # one full unit: A's prompt, B's first unit
B_TOKENS = SHARED_UNIT + [50, 51, 52, 53]        # then a unit of B's own


def cache_a_and_b_chained_on_it(m) -> None:
    """Sequences 0 (A) and 1 (B) hold ``SHARED_UNIT``, both allocated before either computed
    it (no hit), so B's copy is a duplicate, left unregistered. Both compute it; B appends and
    computes its second unit, chained on A's registration; both finish. A's unit 0 and B's
    unit 1 are then cached, A's first (lru)."""
    unit_tokens = len(SHARED_UNIT)
    m.mark_computed(0, unit_tokens)
    m.mark_computed(1, unit_tokens)
    m.append(1, unit_tokens, B_TOKENS[unit_tokens:])
    m.mark_computed(1, 2 * unit_tokens)
    m.free(0)
    m.free(1)
