"""The memory check charges a pool page (vmem) or block (paged) by its geometry
(scheduler/sim_memory.py ``pool_unit_bytes``), at least what the manager's tables take: each
geometry's tables are measured here with tracemalloc on a small pool (the manager built and its
integrity checked, per unit beyond a pool a quarter the size). Every unit was charged an
interleaved token page's 1,152 bytes, so llama-3-8b with 120 GB of cache at 4 KiB pages (29
million pages, 2.4 GB of tables) was charged 34 GB and refused on a 23 GiB host; a byte-mapped
interleaved page (1,280) was charged a tenth short."""
import gc
import tracemalloc

import pytest

from vmemkv.scheduler import sim_memory
from vmemkv.scheduler.geometry import PageGeometry
from vmemkv.scheduler.managers.paged_groups import block_groups
from vmemkv.scheduler.presets import MODELS
from vmemkv.scheduler.sim_memory import (SimulationTooLargeError, check_simulation_fits,
                                         pool_unit_bytes, simulation_bytes)
from vmemkv.scheduler.simulator import SimConfig

GROUPS = 400        # page groups (vmem) or blocks (paged) of the measured pool


def vmem(model, layout, page_bytes, groups=GROUPS, max_seq_len=64):
    """``model``'s vmem pool of ``groups`` whole page groups of ``page_bytes`` pages."""
    group_pages = PageGeometry.of(MODELS[model], page_bytes, layout).pages_per_group
    return SimConfig(model=model, policy="vmem", layout=layout, page_bytes=page_bytes,
                     max_seq_len=max_seq_len, cache_bytes=groups * group_pages * page_bytes)


def paged(model, block_size, blocks=GROUPS):
    spec = MODELS[model]
    block_bytes = block_size * 2 * len(block_groups(spec)[0].layers) * spec.layer_bytes_per_token
    return SimConfig(model=model, policy="paged", block_size=block_size, max_seq_len=64,
                     cache_bytes=blocks * block_bytes)


GEOMETRIES = {   # name: (pool of GROUPS, the same a quarter the size)
    "interleaved, a token a page": lambda g: vmem("tiny", "interleaved", 2048, g),
    "interleaved, byte-mapped": lambda g: vmem("tiny", "interleaved", 3072, g, 66),
    "per-layer, a token a page": lambda g: vmem("tiny", "per-layer", 512, g),
    "per-layer, byte-mapped": lambda g: vmem("tiny", "per-layer", 768, g, 66),
    "per-layer, full attention": lambda g: vmem("llama-3-8b", "per-layer", 4096, g),
    "per-layer, hybrid split": lambda g: vmem("gemma-3-27b", "per-layer", 4096, g),
    "per-layer, sliding window": lambda g: vmem("mistral-7b-v0.1", "per-layer", 4096, g),
    "paged, a token a block": lambda g: paged("tiny", 1, g),
    "paged, 16 tokens a block": lambda g: paged("llama-3-8b", 16, g),
}


def tables_peak_bytes(config: SimConfig) -> int:
    """tracemalloc's peak while ``config``'s manager is built and checks its integrity."""
    gc.collect()
    tracemalloc.start()
    try:
        config.make_manager().check_integrity()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", GEOMETRIES)
def test_each_geometry_is_charged_at_least_what_its_tables_take_per_unit(name):
    small, large = GEOMETRIES[name](GROUPS // 4), GEOMETRIES[name](GROUPS)
    tables_peak_bytes(small)                       # imports and caches: not measured
    units = large.pool_units - small.pool_units
    measured = (tables_peak_bytes(large) - tables_peak_bytes(small)) / units
    charged = pool_unit_bytes(large)
    assert pool_unit_bytes(small) == charged       # a function of the geometry, not the size
    assert measured <= charged, (name, measured, charged)
    assert charged <= 3 * measured, (name, measured, charged)    # not the worst's everywhere


def test_the_worst_geometry_is_charged_the_most_and_others_less():
    charges = {name: pool_unit_bytes(make(GROUPS)) for name, make in GEOMETRIES.items()}
    assert charges["interleaved, byte-mapped"] == max(charges.values()) == 1280
    assert charges["interleaved, a token a page"] == 1152           # the old charge of every unit
    assert charges["per-layer, full attention"] == 160
    assert charges["paged, a token a block"] == charges["paged, 16 tokens a block"] == 320
    assert pool_unit_bytes(SimConfig(policy="reserve-max")) == 0


def test_a_vmem_page_is_charged_the_documented_bytes_its_table_shares_rounded_up():
    """The module docstring's charged column: a page's own 128 (256 byte-mapped) and its
    share of (1,024 x kinds + 1,024) over the pages a group keeps, rounded up (3,072 / 20 kept
    pages of gemma's split group: 153.6 -> 154, so 282; rounding down under-charged it)."""
    charges = {name: pool_unit_bytes(make(GROUPS)) for name, make in GEOMETRIES.items()}
    assert charges["per-layer, hybrid split"] == 282
    assert charges["per-layer, byte-mapped"] == 512 and charges["per-layer, a token a page"] == 384
    assert charges["per-layer, sliding window"] == 160


def test_pool_units_without_their_size_are_refused_not_charged_a_default():
    """A count of units reaching the check without ``unit_bytes`` was charged 1,152 bytes each,
    a tenth short of a byte-mapped interleaved page's 1,280: a silently low charge."""
    config = GEOMETRIES["interleaved, byte-mapped"](GROUPS)
    units, unit_bytes = config.pool_units, pool_unit_bytes(config)
    assert (units, unit_bytes) == (1600, 1280)            # the worst geometry
    for charge in (lambda: simulation_bytes(10, 100, units),
                   lambda: check_simulation_fits(10, 100, pool_units=units)):
        with pytest.raises(TypeError, match=f"pool_units={units} given without unit_bytes"):
            charge()
    assert simulation_bytes(10, 100, units, unit_bytes=unit_bytes) == \
        simulation_bytes(10, 100) + units * 1280
    assert simulation_bytes(10, 100, 0) == simulation_bytes(10, 100)     # no units: no size


def test_llama_with_120_gb_of_4_kib_pages_is_not_refused_by_the_charge(monkeypatch):
    config = SimConfig(model="llama-3-8b", policy="vmem", page_bytes=4096,
                       cache_bytes=120 * 10**9)
    assert config.resolved_layout == "per-layer" and config.pool_units == 29_296_875
    need = simulation_bytes(100, 10_000, config.pool_units, unit_bytes=pool_unit_bytes(config))
    assert need == 8 * 2**20 + 100 * 1024 + 10_000 * 48 + 29_296_875 * 160     # 4.7 GB
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: 23 * 2**30)
    check_simulation_fits(100, 10_000, pool_units=config.pool_units,
                          unit_bytes=pool_unit_bytes(config))
    # the charge still refuses a host too small for the tables: exactly at the need
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: need - 1)
    with pytest.raises(SimulationTooLargeError, match=f"needs about {need} bytes"):
        check_simulation_fits(100, 10_000, pool_units=config.pool_units,
                              unit_bytes=pool_unit_bytes(config))
    monkeypatch.setattr(sim_memory, "available_bytes", lambda: need)
    check_simulation_fits(100, 10_000, pool_units=config.pool_units,
                          unit_bytes=pool_unit_bytes(config))
