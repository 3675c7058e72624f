"""How much host memory a simulation takes, checked before a workload is drawn and before a run.

A simulation holds each request (its entry, request, sequence and timing records) and the time
of each output token, and its serving report pools every inter-token gap; measured with
tracemalloc on the standard workload (2026-12-06; tests/scheduler/test_sim_memory.py checks the
charge stays above what it measures): about 6 MB fixed and 37 bytes an output token (request
records included) at the peak, 14-20 KB a request; the process's resident size is about 1.2
times that. ``simulation_bytes`` charges 8 MiB, 1 KiB a request and 48 bytes an output token;
drawing a workload alone, 512 bytes a request; the manager's tables, ``pool_unit_bytes`` a pool
page or block (below); drawing LoRA adapters for a workload, 512 bytes an adapter of the
population (372 at the peak, tracemalloc, 2026-12-06: its name, digest and popularity weight;
``--lora-adapters 1000000`` held 455 MB resident). A request's extra samples (``--n``) or beams
(``--beam-width``) are charged 16 bytes an output token each (8.5 measured at n=16: only the
first is timed) and 1 KiB a sample (450 measured) or 8 KiB a beam (6 KB measured with 500 beams
live at once; 1.4 KB at width 16, so the charge is up to 5 times what beams of 16 take). A run
that would need more than the host's MemAvailable is refused (``SimulationTooLargeError``:
``vmemkv simulate`` checks its estimate before it draws, ``generate`` what it draws,
``simulate`` the entries and the pool it is given) before anything is drawn or run, instead of
taking the machine into the OOM killer (``vmemkv simulate --requests 10000000`` needs about 177
GiB). A sweep's worker processes run at once, so each is checked against its share
(``set_concurrent_simulations``).

A pool page or block is charged by its geometry (``pool_unit_bytes``): what its tables take,
measured with tracemalloc per unit beyond a pool a quarter the size (the manager built and its
integrity checked, which copies each table once more; 2026-12-07), with a margin. A vmem page
takes about 56 bytes of its own (ledger records, its place in its group's extent), 80-115 more
where a member spans several pages (byte-mapped), and a share of its group's tables (about
830 a group and a layer kind it has extents in; 2,600 a hybrid's split group of two kinds) and
of its slot's (about 830): a pool has a group per pages a group keeps (2 in the interleaved
layout, 2 x layers per-layer, 2 x full-attention layers in a hybrid's split group) and a slot
per pages of one of each member. A page is charged ``PAGE_BYTES`` (128),
``BYTE_MAPPED_PAGE_BYTES`` (128) more when byte-mapped, and (``GROUP_KIND_BYTES`` x kinds +
``SLOT_BYTES``) / pages a group keeps, 1,024 each (a split group's slot share is charged over
its fewer kept pages, which covers its groups' 2,600):

    geometry                                     measured  charged   (bytes a page or block)
    interleaved, byte-mapped (tiny, 3 KiB)         1,094     1,280   the presets' worst
    interleaved, a token a page (tiny, llama)        898     1,152   1,036 with a full pool
    per-layer, byte-mapped (tiny, 768 B)             385       512
    per-layer (tiny, 512 B)                          265       384
    per-layer, hybrid split (gemma-3-27b, 4 KiB)     193       282   169 with a full pool
    per-layer, byte-mapped (phi-2, 8 KiB, 2 MiB)     161-176   288
    per-layer (llama-3-8b, 4 KiB)                     82       160   87 with a full pool
    paged block (any model, block size)              247       320

so ``vmemkv simulate`` of llama-3-8b with ``--cache-gb 120 --page-bytes 4KiB`` (29 million
pages) is charged 4.7 GB. Until 2026-12-07 every unit was charged 1,152 bytes, the interleaved
page's, which charged that run 34 GB and refused it on a 23 GiB host; before that 96 bytes,
measured on llama-3-8b alone, which let ``--model-preset tiny --cache-gb 130 --page-bytes
1024`` start towards 34 GB (tests/scheduler/test_sim_memory_presets.py measures every preset
and policy family, tests/scheduler/test_sim_memory_charge.py each geometry above). A count of
units given without their size is refused (TypeError), not charged a default: the 1,152 bytes
kept for that under-charged a byte-mapped interleaved page (1,280) by a tenth.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from .errors import ConfigError

if TYPE_CHECKING:
    from .geometry import PageGeometry
    from .sim_config import SimConfig

BASE_BYTES = 8 << 20      # the manager's tables (the latency logs: with the tokens)
REQUEST_BYTES = 1024      # a request's records, kept for the whole run
TOKEN_BYTES = 48          # an output token: its time, then its gap in the report (pooled, sorted)
ENTRY_BYTES = 512         # a drawn request: its TraceEntry and its share of the draw (270 measured)
PAGE_BYTES = 128          # a vmem pool page's own records (56 measured)
BYTE_MAPPED_PAGE_BYTES = 128   # more a page where a member spans several pages (80-115 measured)
GROUP_KIND_BYTES = 1024   # a page group's tables, per layer kind it has extents in (830 measured)
SLOT_BYTES = 1024         # a slot's tables (830 measured)
BLOCK_BYTES = 320         # a paged block's tables (247 measured)
SAMPLE_TOKEN_BYTES = 16  # an output token of a sample or beam after the first (untimed)
SAMPLE_BYTES = 1024      # a request's sample after the first (--n): its sequence's records
BEAM_BYTES = 8192        # a beam after the first: its sequence's records, forks and prunes
ADAPTER_BYTES = 512       # a LoRA adapter of the population drawn from (372 measured)
_concurrent = 1           # simulations this process shares the host with (a sweep's workers)


class SimulationTooLargeError(ConfigError, MemoryError):
    """A simulation would need more host memory than is available; nothing was drawn or run.
    The message gives the requests, the output tokens, both sizes in bytes and what to lower."""


def set_concurrent_simulations(count: int) -> None:
    """This process runs one of ``count`` simulations at once: checks use 1/count of the host."""
    global _concurrent
    _concurrent = max(1, int(count))


def simulation_bytes(num_requests: int, output_tokens: int, pool_units: int = 0,
                     n: int = 1, beam_width: int = 0,
                     unit_bytes: Optional[int] = None) -> int:
    """Host memory a simulation of ``num_requests`` with ``output_tokens`` in all (one sequence
    each) needs, bytes, on a manager of ``pool_units`` pages or blocks of ``unit_bytes`` each
    (``pool_unit_bytes``); each request running ``n`` samples or ``beam_width`` beams (0: none)
    of that many tokens each. Units without their size are refused (TypeError): no one size
    is right for every geometry, and a guess would under-charge some."""
    if pool_units and unit_bytes is None:
        raise TypeError(f"simulation_bytes: pool_units={pool_units} given without unit_bytes; "
                        f"a unit's charge depends on its geometry (pass pool_unit_bytes(config))")
    extra = (beam_width or n) - 1           # sequences per request after the first
    per_sequence = BEAM_BYTES if beam_width else SAMPLE_BYTES
    return (BASE_BYTES + num_requests * REQUEST_BYTES + output_tokens * TOKEN_BYTES
            + extra * (num_requests * per_sequence + output_tokens * SAMPLE_TOKEN_BYTES)
            + pool_units * (unit_bytes or 0))


def pool_unit_bytes(config: "SimConfig") -> int:
    """Bytes of host memory a page (vmem) or block (paged) of ``config``'s pool is charged for
    the manager's tables (see the module docstring); 0 for a pool of no such units."""
    from .managers import PagedManager, VmemManager
    if config.pool_base is PagedManager:
        return BLOCK_BYTES
    if config.pool_base is not VmemManager:
        return 0
    from .geometry import PageGeometry
    geometry = PageGeometry.of(config.model_spec, config.page_bytes, config.resolved_layout)
    return vmem_page_bytes(geometry, config.hybrid_parts and geometry.split)


def vmem_page_bytes(geometry: "PageGeometry", split: bool) -> int:
    """Bytes a vmem pool page of ``geometry`` is charged: its own, and its share of its group's
    and its slot's tables among the pages a group keeps (``split``: groups split by layer kind,
    keeping the full-attention layers' pages; scheduler.managers.kinds.VmemShape)."""
    kinds, kept = (2, 2 * len(geometry.full_layers)) if split else (1, geometry.num_members)
    own = PAGE_BYTES + (0 if geometry.exact else BYTE_MAPPED_PAGE_BYTES)
    return own + math.ceil((GROUP_KIND_BYTES * kinds + SLOT_BYTES) / kept)


def available_bytes() -> Optional[int]:
    """The host's MemAvailable in bytes (None when /proc/meminfo cannot be read). Read here,
    not through ``vmem.host.meminfo_bytes``: the scheduler depends on no other layer."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_simulation_fits(num_requests: int, output_tokens: int,
                          remedy: str = "simulate fewer requests", pool_units: int = 0,
                          n: int = 1, beam_width: int = 0,
                          unit_bytes: Optional[int] = None) -> None:
    """SimulationTooLargeError when the simulation (``simulation_bytes``) needs more than this
    process's share of the host's available memory; TypeError for ``pool_units`` without
    ``unit_bytes``, as there."""
    pool = f" on a pool of {pool_units:,} pages or blocks" if pool_units else ""
    width = beam_width or n
    each = (f", run as {width:,} {'beams' if beam_width else 'samples'} each "
            f"({width * output_tokens:,} tokens)" if width > 1 else "")
    check_host_need(f"a simulation of {num_requests:,} requests with {output_tokens:,} output "
                    f"tokens{each}{pool}",
                    simulation_bytes(num_requests, output_tokens, pool_units, n, beam_width,
                                     unit_bytes), remedy)


def check_workload_fits(num_requests: int, remedy: str) -> None:
    """SimulationTooLargeError when drawing ``num_requests`` (their entries, ``ENTRY_BYTES``
    each) needs more than this process's share of the host's available memory."""
    check_host_need(f"drawing a workload of {num_requests:,} requests",
                    num_requests * ENTRY_BYTES, remedy)


def check_adapters_fit(num_adapters: int, remedy: str) -> None:
    """SimulationTooLargeError when drawing from ``num_adapters`` LoRA adapters (``ADAPTER_BYTES``
    each) needs more than this process's share of the host's available memory."""
    check_host_need(f"drawing from {num_adapters:,} LoRA adapters",
                    num_adapters * ADAPTER_BYTES, remedy)


def check_host_need(what: str, need: int, remedy: str) -> None:
    """SimulationTooLargeError when ``need`` bytes for ``what`` pass this process's share of the
    host's available memory (the check every figure above goes through)."""
    available = available_bytes()
    if available is None or need * _concurrent <= available:
        return
    share = (f"a 1/{_concurrent} share ({available // _concurrent} bytes) of "
             if _concurrent > 1 else "")
    raise SimulationTooLargeError(
        f"{what} needs about {need} bytes ({need / 2**30:.2f} GiB) of host memory, more than "
        f"{share}the host MemAvailable of {available} bytes ({available / 2**30:.2f} GiB); "
        f"{remedy}")
