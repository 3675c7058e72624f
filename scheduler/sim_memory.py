"""How much host memory a simulation takes, checked before a workload is drawn and before a run.

A simulation holds each request (its entry, request, sequence and timing records) and the time
of each output token, and its serving report pools every inter-token gap; measured with
tracemalloc on the standard workload (2026-12-06; tests/scheduler/test_sim_memory.py checks the
charge stays above what it measures): about 6 MB fixed and 37 bytes an output token (request
records included) at the peak, 14-20 KB a request; the process's resident size is about 1.2
times that. ``simulation_bytes`` charges 8 MiB, 1 KiB a request and 48 bytes an output token;
drawing a workload alone, 512 bytes a request; the manager's tables, ``POOL_UNIT_BYTES`` a pool
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

A pool page or block is charged 1,152 bytes, what the worst geometry takes with a margin: a
page's ledger records and unit counts, and a page group and a slot to every two pages at most
(a group holds a page of each member, two at the fewest: the interleaved layout's K and V),
each table copied once more while an idle manager checks its integrity. A run on tiny's
interleaved pool of one-token pages takes 882 bytes a page at its peak (tracemalloc, per page
beyond a pool a quarter the size; 928 resident at a million pages); a paged block takes 247, a
per-layer page 80 (llama-3-8b) to 261 (tiny), charged up to 14 times that: ``--cache-gb 120
--page-bytes 4KiB`` on llama-3-8b (29 million pages, 2.5 GB) is charged 34 GB. The charge was
96 bytes, measured on llama-3-8b alone, and let ``--model-preset tiny --cache-gb 130
--page-bytes 1024`` start towards 34 GB (tests/scheduler/test_sim_memory_presets.py measures
every preset and policy family).
"""
from __future__ import annotations

from typing import Optional

from .errors import ConfigError

BASE_BYTES = 8 << 20      # the manager's tables (the latency logs: with the tokens)
REQUEST_BYTES = 1024      # a request's records, kept for the whole run
TOKEN_BYTES = 48          # an output token: its time, then its gap in the report (pooled, sorted)
ENTRY_BYTES = 512         # a drawn request: its TraceEntry and its share of the draw (270 measured)
POOL_UNIT_BYTES = 1152    # a pool page (vmem) or block (paged) in the manager's tables (882 max)
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
                     n: int = 1, beam_width: int = 0) -> int:
    """Host memory a simulation of ``num_requests`` with ``output_tokens`` in all (one sequence
    each) needs, bytes, on a manager of ``pool_units`` pages or blocks; each request running
    ``n`` samples or ``beam_width`` beams (0: none) of that many tokens each."""
    extra = (beam_width or n) - 1           # sequences per request after the first
    per_sequence = BEAM_BYTES if beam_width else SAMPLE_BYTES
    return (BASE_BYTES + num_requests * REQUEST_BYTES + output_tokens * TOKEN_BYTES
            + extra * (num_requests * per_sequence + output_tokens * SAMPLE_TOKEN_BYTES)
            + pool_units * POOL_UNIT_BYTES)


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
                          n: int = 1, beam_width: int = 0) -> None:
    """SimulationTooLargeError when the simulation (``simulation_bytes``) needs more than this
    process's share of the host's available memory."""
    pool = f" on a pool of {pool_units:,} pages or blocks" if pool_units else ""
    width = beam_width or n
    each = (f", run as {width:,} {'beams' if beam_width else 'samples'} each "
            f"({width * output_tokens:,} tokens)" if width > 1 else "")
    check_host_need(f"a simulation of {num_requests:,} requests with {output_tokens:,} output "
                    f"tokens{each}{pool}",
                    simulation_bytes(num_requests, output_tokens, pool_units, n, beam_width), remedy)


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
