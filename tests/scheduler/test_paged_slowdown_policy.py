"""``paged_slowdown`` applies to the paged manager and to a user's subclass of it (a subclass
read its blocks at the built-in's speed, silently). Other policies do not read blocks and take
it as 1 (``SimConfig.paged_slowdown``; the CLI refuses the flag for them by name)."""
from pathlib import Path

import pytest

from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

SUBCLASS = f"{Path(__file__).with_name('custom_policy.py')}:CoarseBlocks"


def _tok_s(policy, slowdown, **options):
    entries = generate(WorkloadSpec(num_requests=20, seed=0))
    config = SimConfig(policy=policy, cache_bytes=2 * 10**9, paged_slowdown=slowdown, **options)
    return simulate(entries, config).output_tokens_per_s


def test_a_subclass_of_paged_is_slowed_as_the_paged_manager_is():
    built_in = _tok_s("paged", 2.0, block_size=64) / _tok_s("paged", 1.0, block_size=64)
    subclass = _tok_s(SUBCLASS, 2.0) / _tok_s(SUBCLASS, 1.0)
    assert built_in < 0.99 and subclass == pytest.approx(built_in, rel=1e-9)
