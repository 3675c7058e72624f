"""Map and unmap latency per page, per driver and page size (µs per page, median of repeats).

    python -m benchmarks.alloc [--quick] [--out bench_out/alloc.json]

Each repeat maps ``--pages`` pool pages at consecutive indices of a fresh-looking range, then
unmaps them; the figure is the median over repeats of (total time / pages). Pages come from a
pool created up front, so the timing never includes page creation -- exactly the cost a cache
pays when a request grows. The host pool is fallocated up front, so first-touch cost is not
included either (the page cache already holds the pages).
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import environment, format_table, median_seconds, print_environment, write_json

KiB, MiB = 2**10, 2**20
HOST_PAGE_SIZES = (4 * KiB, 64 * KiB, 2 * MiB)
CUDA_PAGE_SIZES = (2 * MiB,)


def measure(driver, page_bytes: int, num_pages: int, warmup: int, repeats: int) -> dict:
    import vmem
    timings = {"map": [], "unmap": []}
    with vmem.PagePool(driver, num_pages, page_bytes) as pool, \
            vmem.VirtualRange(pool, num_pages * page_bytes) as rng:
        pages = pool.allocate(num_pages)

        def cycle():
            start = time.perf_counter()
            for index, page in enumerate(pages):
                rng.map(index, page)
            mid = time.perf_counter()
            for index in range(num_pages):
                rng.unmap(index)
            end = time.perf_counter()
            timings["map"].append((mid - start) / num_pages)
            timings["unmap"].append((end - mid) / num_pages)

        median_seconds(cycle, warmup, repeats)
        for page in pages:
            pool.release(page)
    del timings["map"][:warmup], timings["unmap"][:warmup]
    import statistics
    map_us = statistics.median(timings["map"]) * 1e6
    unmap_us = statistics.median(timings["unmap"]) * 1e6
    return {"driver": driver.name, "page_size": human_bytes(page_bytes), "page_bytes": page_bytes,
            "pages": num_pages, "map_us": map_us, "unmap_us": unmap_us,
            "map_unmap_us": map_us + unmap_us}


def human_bytes(num_bytes: int) -> str:
    return f"{num_bytes // MiB} MiB" if num_bytes >= MiB else f"{num_bytes // KiB} KiB"


def run(quick: bool = False, out: str | None = None, pages: int | None = None) -> dict:
    import vmem
    warmup, repeats = (1, 5) if quick else (3, 21)
    num_pages = pages or (64 if quick else 256)
    env = environment(seed=0, warmup=warmup, repeats=repeats, pages_per_repeat=num_pages)
    print_environment(env)
    rows = []
    drivers = vmem.available_drivers()
    for name, sizes in (("host", HOST_PAGE_SIZES), ("cuda", CUDA_PAGE_SIZES)):
        if drivers[name]:
            print(f"# {name} driver skipped: {drivers[name]}")
            continue
        driver = vmem.open_driver(name)
        env[f"{name}_granularity_bytes"] = driver.granularity_bytes
        for page_bytes in sizes:
            rows.append(measure(driver, page_bytes, num_pages, warmup, repeats))
    print(format_table(rows, ["driver", "page_size", "pages", "map_us", "unmap_us", "map_unmap_us"]))
    payload = {"benchmark": "alloc", "environment": env, "results": rows}
    write_json(out, payload)
    return payload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (seconds, not minutes)")
    parser.add_argument("--pages", type=int, default=None, help="pages mapped per repeat")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    run(args.quick, args.out, args.pages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
