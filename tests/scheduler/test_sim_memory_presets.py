"""The memory check's charge for a manager's tables (scheduler/sim_memory.py pool_unit_bytes, a
pool page or block, by its geometry) covers what every preset's pool takes under every policy family, measured
with tracemalloc while the manager is built and a short simulation runs. It was 96 bytes,
measured on llama-3-8b alone: tiny's pool of 4 KiB pages took 270 bytes a page (1.3 GB resident
at 20 GB of cache, charged 0.47 GB) and its interleaved pool 880, so ``vmemkv simulate
--model-preset tiny --cache-gb 130 --page-bytes 1024`` was charged 12 GB, passed the check and
grew towards 34 GB, more than the host. Each vmem pool here has the most pages, groups and
slots a cache of its bytes can have in its layout."""
import gc
import tracemalloc

import pytest

from vmemkv.scheduler.managers.paged_groups import block_groups
from vmemkv.scheduler.presets import MODELS
from vmemkv.scheduler.sim_memory import pool_unit_bytes, simulation_bytes
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

UNITS = 2_000            # pages or blocks of the measured pool (a quarter of it: the baseline)
MAX_LEN = 64             # tokens a sequence may reach: pages per slot, with one token a page
ENTRIES = generate(WorkloadSpec(num_requests=8, seed=3, max_total_len=MAX_LEN))
TOKENS = sum(e.output_len for e in ENTRIES)


def _pool(model: str, family: str, units: int) -> SimConfig:
    """``model``'s pool of ``units`` pages or blocks: an interleaved page of one token (a
    page group of two members, the fewest: a group and a slot to every two pages), a per-layer
    page of 32 tokens of one layer's K or V (2 x layers members), a paged block of 8 tokens (a
    sequence fits a quarter of ``UNITS`` of each); a reserve pool of ``units`` tokens."""
    spec = MODELS[model]
    if family == "paged":        # a block holds one block group's layers (31 groups: gemma's)
        block_bytes = 8 * 2 * len(block_groups(spec)[0].layers) * spec.layer_bytes_per_token
        return SimConfig(model=model, policy="paged", block_size=8, max_seq_len=MAX_LEN,
                         cache_bytes=units * block_bytes)
    if family == "reserve-max":
        return SimConfig(model=model, policy=family, max_seq_len=MAX_LEN,
                         cache_bytes=units * spec.bytes_per_token)
    layout = family.split()[1]
    page_bytes = 32 * spec.layer_bytes_per_token if layout == "per-layer" else spec.bytes_per_token
    return SimConfig(model=model, policy="vmem", layout=layout, page_bytes=page_bytes,
                     max_seq_len=MAX_LEN, cache_bytes=units * page_bytes)


def _run_peak_bytes(config: SimConfig) -> int:
    """tracemalloc's peak while ``config``'s manager is built and runs ENTRIES."""
    gc.collect()
    tracemalloc.start()
    try:
        result = simulate(ENTRIES, config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.num_requests == len(ENTRIES) and result.output_tokens == TOKENS
    return peak


# gemma-3-27b's paged pool keeps a block of each group of 2 layers (31 a token): SimConfig
# counts its units as such blocks (it counted one block of all 62 layers: 31 times too few)
CASES = [(model, family) for model in MODELS
         for family in ("vmem per-layer", "vmem interleaved", "paged", "reserve-max")]


@pytest.mark.parametrize("model, family", CASES)
def test_the_charge_covers_each_presets_pool_per_unit_and_in_all(model, family):
    """Per unit: what the run takes beyond the same run on a pool a quarter the size is at most
    the charge for the units between (the fixed 8 MiB base cannot hide a short charge); in
    all: the run's peak is at most ``simulation_bytes``."""
    small, large = _pool(model, family, UNITS // 4), _pool(model, family, UNITS)
    assert large.pool_units == (0 if family == "reserve-max" else UNITS)   # what is charged
    simulate(ENTRIES, small)                      # its imports and caches: not measured
    small_peak, peak = _run_peak_bytes(small), _run_peak_bytes(large)
    units, unit_bytes = large.pool_units - small.pool_units, pool_unit_bytes(large)
    # 4 KiB: a run's own jitter (reserve: its tables are per sequence, the same in both)
    assert peak - small_peak <= units * unit_bytes + 4096, (
        f"{(peak - small_peak) / max(1, units):.0f} bytes a unit, charged {unit_bytes}", peak,
        small_peak)
    assert peak <= simulation_bytes(len(ENTRIES), TOKENS, large.pool_units,
                                    unit_bytes=unit_bytes), peak
