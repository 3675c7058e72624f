"""One declared interface: callers use what MemoryManager declares, never probe managers."""
import pathlib
import re

import pytest

from vmemkv.scheduler.managers import POLICIES, MemoryManager, make_manager
from vmemkv.scheduler.presets import ModelSpec

ONE_LAYER = ModelSpec("t1", 1, 1, 1, 1, weight_bytes=0)
ROOT = pathlib.Path(__file__).resolve().parents[2]
CALLERS = ["scheduler/scheduler.py", "scheduler/simulator.py", "runtime/engine/engine.py"]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_answers_the_whole_declared_interface(policy):
    m = make_manager(policy, ONE_LAYER, 2 * 64 * 8, 64, block_size_tokens=4, page_bytes=4)
    assert isinstance(m, MemoryManager) and m.name == policy
    assert 1 <= m.max_sequence_tokens <= m.max_seq_len == 64
    assert m.pages_per_map_op == (2 if policy == "vmem" else 1)   # one layer: K and V pages
    assert (m.prefix_queries, m.prefix_hits, m.in_transaction) == (0, 0, False)
    assert not m.can_swap_out(0) and not m.is_swapped(0)


@pytest.mark.parametrize("path", CALLERS)
def test_callers_do_not_probe_managers(path):
    source = (ROOT / path).read_text()
    assert not re.search(r"getattr\([^,]*manager", source), "probe with getattr"
    assert not re.search(r"manager\.name\s*(==|!=|in)", source), "branch on a policy name"
