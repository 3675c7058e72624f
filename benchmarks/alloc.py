"""Map and unmap latency per page, per driver and page size (µs per page, median of repeats),
page create/release and discard/recreate cost, and the time a decode loop waits for the page
mapper with and without overlap.

    python -m vmemkv.benchmarks.alloc [--quick] [--out bench_out/alloc.json]

Each repeat maps ``--pages`` pool pages at consecutive indices of a fresh-looking range, then
unmaps them; the figure is the median over repeats of (total time / pages). Pages come from a
pool created up front, so the timing never includes page creation -- exactly the cost a cache
pays when a request grows. The host pool is fallocated up front, so first-touch cost is not
included either (the page cache already holds the pages).

Page lifecycle (``lifecycle``): the driver calls behind elastic memory, one page per call, µs
per page (median over repeats of total / pages): ``create_pages(1)`` then ``release_pages`` of
it, and ``discard_pages`` then ``recreate_pages`` of one page of a pool (vmem/pool.py's
``discard`` / re-creation on mapping). CUDA rows stand beside the published A100 figures for
2 MiB pages (``PUBLISHED_A100``: the kvcached / vAttention papers), as do the map/unmap rows
(our map is cuMemMap + cuMemSetAccess, our unmap cuCtxSynchronize + cuMemUnmap).

Lock cost (``lock_cost``): the same map + unmap cycles on one host pool with its lock (every
pool and range call holds it, vmem/pool.py) and with a no-op lock in its place, the two
interleaved repeat by repeat; ``locked_over_bare`` is the price of thread safety as a ratio.

Mapper overlap (``mapper_loop``): a real ``VMemKVCache`` (per-layer layout) runs a synthetic
decode loop. Requests start at staggered lengths, so every step one of them crosses a page
boundary and the manager plans a MapExtent (2 x layers pool pages); each step then writes every
layer's new K/V and does that layer's compute (attention over the cache with the fastest backend
for the device, ``cpu-varlen`` on the CPU, plus an MLP-sized matmul). Inline
(``background_mapper=False``) the step waits for all of its mapping; with the background
mapper, layer l's pages are mapped while layers < l compute, and the step waits only when a
layer's pages are not ready yet. Reported: mapping time (spent applying the plans) and
wait time (the step thread blocked on them), in ms, each the median over repeats;
``wait_saved_pct`` is the wait the background mapper saves against the inline run's
(1 - background wait / inline wait). It is not measured against the background thread's own
mapping time: that thread maps more slowly while it shares the cores with the compute, so
"the share of its mapping not waited for" would overstate the gain over inline mapping.
"""
from __future__ import annotations

import time

from vmemkv.benchmarks.common import (busy_warnings, environment, exit_status, format_table,
                                      median_seconds, print_environment, write_json)
from vmemkv.cli import OneLineArgumentParser
from vmemkv.scheduler.cost import count_map_ops
from vmemkv.scheduler.cliargs import POSITIVE_INT, result_file

KiB, MiB = 2**10, 2**20
HOST_PAGE_SIZES = (4 * KiB, 64 * KiB, 2 * MiB)
CUDA_PAGE_SIZES = (2 * MiB,)
# µs per 2 MiB page on an A100, as the kvcached / vAttention papers report them
PUBLISHED_A100 = {"source": "kvcached / vAttention papers", "page_bytes": 2 * MiB,
                  "cuMemCreate_us": 193.0, "cuMemMap_us": 1.45, "cuMemSetAccess_us": 36.0,
                  "cuMemUnmap_us": 26.0}


def measure(driver, page_bytes: int, num_pages: int, warmup: int, repeats: int) -> dict:
    from vmemkv import vmem
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
    cycles_us = [(m + u) * 1e6 for m, u in zip(timings["map"], timings["unmap"])]
    return {"driver": driver.name, "page_size": human_bytes(page_bytes), "page_bytes": page_bytes,
            "pages": num_pages, "map_us": map_us, "unmap_us": unmap_us,
            "map_unmap_us": map_us + unmap_us, "map_unmap_us_min": min(cycles_us),
            "map_unmap_us_max": max(cycles_us)}


def _published(row: dict, **columns: str) -> dict:
    """``row`` with the published A100 figures (sums of PUBLISHED_A100 keys) beside its own,
    for CUDA 2 MiB pages only."""
    if row["driver"] == "cuda" and row["page_bytes"] == PUBLISHED_A100["page_bytes"]:
        for column, keys in columns.items():
            row[column] = sum(PUBLISHED_A100[key] for key in keys.split("+"))
    return row


def lifecycle(driver, page_bytes: int, num_pages: int, warmup: int, repeats: int) -> dict:
    """µs per page of one-page driver calls: create + release, and discard + recreate."""
    import statistics
    samples: dict[str, list[float]] = {"create": [], "release": [], "discard": [],
                                       "recreate": []}
    pool = list(driver.create_pages(num_pages, page_bytes))   # the pages discard works on
    try:
        for _ in range(warmup + repeats):
            times = {}
            start = time.perf_counter()
            made = [driver.create_pages(1, page_bytes) for _ in range(num_pages)]
            mid = time.perf_counter()
            for handles in made:
                driver.release_pages(handles)
            end = time.perf_counter()
            times["create"], times["release"] = mid - start, end - mid
            start = time.perf_counter()
            for handle in pool:
                driver.discard_pages([handle], page_bytes)
            mid = time.perf_counter()
            pool = [driver.recreate_pages([handle], page_bytes)[0] for handle in pool]
            end = time.perf_counter()
            times["discard"], times["recreate"] = mid - start, end - mid
            for key, seconds in times.items():
                samples[key].append(seconds / num_pages * 1e6)
    finally:
        driver.release_pages(pool)
    row = {"driver": driver.name, "page_size": human_bytes(page_bytes), "page_bytes": page_bytes,
           "pages": num_pages}
    for key, values in samples.items():
        row[f"{key}_us"] = statistics.median(values[warmup:])
    row["create_release_us"] = row["create_us"] + row["release_us"]
    row["discard_recreate_us"] = row["discard_us"] + row["recreate_us"]
    return _published(row, a100_create_us="cuMemCreate_us")


class _NoLock:
    """What the pool's lock is replaced by for the bare half of ``lock_cost`` (never elsewhere)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def lock_cost(driver, page_bytes: int, num_pages: int, repeats: int) -> dict:
    """µs per page of a map + unmap with the pool's lock and without, interleaved."""
    import statistics

    from vmemkv import vmem
    with vmem.PagePool(driver, num_pages, page_bytes) as pool, \
            vmem.VirtualRange(pool, num_pages * page_bytes) as rng:
        pages, real = pool.allocate(num_pages), pool._lock
        samples = {"locked": [], "bare": []}
        try:
            for _ in range(repeats + 1):          # the first round is the warm-up
                for name, lock in (("locked", real), ("bare", _NoLock())):
                    pool._lock = rng._lock = lock
                    start = time.perf_counter()
                    for index, page in enumerate(pages):
                        rng.map(index, page)
                    for index in range(num_pages):
                        rng.unmap(index)
                    samples[name].append((time.perf_counter() - start) / num_pages * 1e6)
        finally:
            pool._lock = rng._lock = real
        pool.release(pages)
    locked, bare = (statistics.median(samples[k][1:]) for k in ("locked", "bare"))
    return {"driver": driver.name, "page_size": human_bytes(page_bytes), "pages": num_pages,
            "locked_us": locked, "bare_us": bare, "locked_over_bare": locked / bare}


def human_bytes(num_bytes: int) -> str:
    return f"{num_bytes // MiB} MiB" if num_bytes >= MiB else f"{num_bytes // KiB} KiB"


# Mapper loop shape: seconds on a 2-core CPU. fp32, 8 KV heads x 128: 4 KiB per token and layer,
# so a 64 KiB host page holds 16 tokens and batch 16 decodes cross one page boundary per step.
MAPPER = dict(layers=8, kv_heads=8, head_dim=128, heads=32, batch=16, hidden=1024,
              page_bytes=64 * KiB, start_tokens=64)


def _mapper_shape(quick: bool, device: str) -> dict:
    shape = dict(MAPPER, steps=12 if quick else 128)
    if device == "cuda":  # the VMM granularity; fp16 (the flash backends' dtype): 1,024 tokens a page
        shape.update(page_bytes=2 * MiB, start_tokens=1024, dtype="float16")
    return shape


def mapper_loop(background: bool, shape: dict, device: str, seed: int = 0) -> dict:
    """One synthetic decode run; returns its mapping, wait and loop times (ms).

    Request i starts at start_tokens + i * g tokens and every step grows each request by
    g = tokens_per_page / batch tokens (g = 1, plain decode, with the CPU shape), so exactly
    one request crosses a page boundary per step and the step maps 2 x layers pages.
    """
    import torch

    from vmemkv.runtime.attention import fastest_backend, get_backend
    from vmemkv.runtime.kv import make_kv
    from vmemkv.runtime.config import CacheConfig
    s = shape
    dtype = getattr(torch, s.get("dtype", "float32"))
    tpp = s["page_bytes"] // (s["kv_heads"] * s["head_dim"] * torch.empty(0, dtype=dtype).element_size())
    grow, batch = max(1, tpp // s["batch"]), s["batch"]
    max_ctx = -(-(s["start_tokens"] + tpp + grow * s["steps"]) // tpp) * tpp
    config = CacheConfig(s["layers"], s["kv_heads"], s["head_dim"], dtype, device, batch, max_ctx)
    gen = torch.Generator(device=device).manual_seed(seed)
    new = dict(generator=gen, device=device, dtype=dtype)
    weight = torch.randn(s["hidden"], s["hidden"], **new) / s["hidden"] ** 0.5
    act = torch.randn(batch * grow, s["hidden"], **new)
    backend = get_backend(fastest_backend("vmem", device, dtype=dtype))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    pair = make_kv(config, "vmem", page_bytes=s["page_bytes"], background_mapper=background)
    with pair.cache as cache:
        mgr = pair.manager
        lengths = [s["start_tokens"] + i * grow for i in range(batch)]   # staggered
        for seq, n in enumerate(lengths):
            mgr.allocate(seq, n)
        cache.execute(mgr.take_ops())
        cache.wait_for_mapper()
        base_map, base_wait = cache.mapping_s, cache.mapper_wait_s
        mapped_pages, start = 0, time.perf_counter()
        for _ in range(s["steps"]):
            for seq in range(batch):
                mgr.append(seq, grow)
            ops = mgr.take_ops()
            mapped_pages += count_map_ops(ops) * mgr.pages_per_group
            cache.execute(ops)
            pair.sync_tables(range(batch))
            cache.begin_step([(seq, lengths[seq], grow) for seq in range(batch)])
            kv = torch.randn(batch * grow, s["kv_heads"], s["head_dim"], **new)
            q = torch.randn(batch * grow, s["heads"], s["head_dim"], **new)
            for layer in range(s["layers"]):
                cache.write(layer, kv, kv)
                backend.forward(q, cache.layer_view(layer))
                act = torch.tanh(act @ weight)                      # (B * g, hidden): the layer's MLP
            sync()
            lengths = [n + grow for n in lengths]
        cache.wait_for_mapper()
        loop = time.perf_counter() - start
        mapping = cache.mapping_s - base_map
        # inline, the step thread itself applies every op: all mapping time is waiting
        wait = cache.mapper_wait_s - base_wait if background else mapping
    return {"mode": "background" if background else "inline", "attention": backend.name, "steps": s["steps"],
            "tokens_per_step": grow, "pages_mapped": mapped_pages, "mapping_ms": mapping * 1e3,
            "wait_ms": wait * 1e3, "loop_ms": loop * 1e3}


def mapper_overlap(quick: bool, device: str, repeats: int, progress=None) -> list[dict]:
    """Median over ``repeats`` of inline and background runs (alternating); one row per mode."""
    import torch
    shape = _mapper_shape(quick, device)
    runs = {False: [], True: []}
    # One intra-op thread: on a small CPU the compute must leave a core to the mapper thread
    # (as a GPU leaves the host CPU free), and on a shared host OpenMP spin-waits otherwise
    # turn each small op into a scheduler time slice.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for background in (False, True):
                runs[background].append(mapper_loop(background, shape, device))
    finally:
        torch.set_num_threads(threads)
    rows = mapper_rows(runs, shape)
    if progress:
        for row in rows:
            progress(f"alloc mapper {row['mode']}")
    return rows


def wait_saved_pct(inline_wait_ms: float, wait_ms: float) -> float:
    """Percent of the inline run's wait that a run did not wait (0 when inline waited nothing)."""
    return 100 * (1 - wait_ms / inline_wait_ms) if inline_wait_ms else 0.0


def mapper_rows(runs: dict, shape: dict) -> list[dict]:
    """One row per mode from ``runs`` ({background: [mapper_loop results]}): medians, the wait's
    range, and ``wait_saved_pct`` against the inline row's median wait."""
    import statistics
    rows = []
    for background, samples in runs.items():
        row = dict(samples[0])
        for key in ("mapping_ms", "wait_ms", "loop_ms"):
            row[key] = statistics.median(r[key] for r in samples)
        row["wait_ms_min"], row["wait_ms_max"] = (f(r["wait_ms"] for r in samples) for f in (min, max))
        row["mapping_pct_of_loop"] = 100 * row["mapping_ms"] / row["loop_ms"] if row["loop_ms"] else 0.0
        row["layers"], row["batch"], row["page_size"] = shape["layers"], shape["batch"], human_bytes(shape["page_bytes"])
        rows.append(row)
    inline = next((r for r in rows if r["mode"] == "inline"), None)
    for row in rows:
        row["wait_saved_pct"] = wait_saved_pct(inline["wait_ms"], row["wait_ms"]) if inline else None
    return rows


def num_configs(quick: bool) -> int:
    """Progress units of ``run``: one per page-size table, one per mapper mode."""
    return 1 + 2


def run(quick: bool = False, out: str | None = None, pages: int | None = None,
        device: str | None = None, progress=None) -> dict:
    import torch

    from vmemkv import vmem
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    warmup, repeats = (1, 5) if quick else (3, 21)
    mapper_repeats = 3 if quick else 5
    num_pages = pages or (64 if quick else 256)
    from vmemkv.benchmarks.suite import versions
    env = environment(seed=0, warmup=warmup, repeats=repeats, device=device, pages_per_repeat=num_pages,
                      mapper_repeats=mapper_repeats, **versions(device))
    print_environment(env)
    rows, pages_rows = [], []
    drivers = vmem.available_drivers()
    for name, sizes in (("host", HOST_PAGE_SIZES), ("cuda", CUDA_PAGE_SIZES)):
        if drivers[name]:
            print(f"# {name} driver skipped: {drivers[name]}")
            continue
        driver = vmem.open_driver(name)
        env[f"{name}_granularity_bytes"] = driver.granularity_bytes
        for page_bytes in sizes:
            rows.append(_published(measure(driver, page_bytes, num_pages, warmup, repeats),
                                   a100_map_us="cuMemMap_us+cuMemSetAccess_us",
                                   a100_unmap_us="cuMemUnmap_us"))
            pages_rows.append(lifecycle(driver, page_bytes, num_pages, warmup, repeats))
    a100 = PUBLISHED_A100
    print(f"# a100_*: published A100 figures for CUDA 2 MiB pages ({a100['source']}): "
          f"cuMemCreate {a100['cuMemCreate_us']} µs, map {a100['cuMemMap_us']} µs + set-access "
          f"{a100['cuMemSetAccess_us']} µs, unmap {a100['cuMemUnmap_us']} µs")
    print(format_table(rows, ["driver", "page_size", "pages", "map_us", "unmap_us", "map_unmap_us",
                              "a100_map_us", "a100_unmap_us"]))
    print("# page create/release and discard/recreate: µs per page, one page per driver call")
    print(format_table(pages_rows, ["driver", "page_size", "pages", "create_us", "release_us",
                                    "discard_us", "recreate_us", "a100_create_us"]))
    lock = []
    if not drivers["host"]:
        lock.append(lock_cost(vmem.open_driver("host"), 4 * KiB, num_pages, repeats))
        print("# the pool lock's cost: map + unmap µs per page with it and with a no-op lock, "
              "interleaved")
        print(format_table(lock, ["driver", "page_size", "pages", "locked_us", "bare_us",
                                  "locked_over_bare"]))
    if progress:
        progress("alloc map/unmap")
    mapper = mapper_overlap(quick, device, mapper_repeats, progress)
    print(f"# mapper overlap on {device}: vmem per-layer cache, {mapper[0]['layers']} layers, batch "
          f"{mapper[0]['batch']}, {mapper[0]['page_size']} pages, attention {mapper[0]['attention']}, "
          f"1 torch thread; median of {mapper_repeats}")
    print(format_table(mapper, ["mode", "steps", "pages_mapped", "mapping_ms", "wait_ms", "wait_saved_pct",
                               "loop_ms", "mapping_pct_of_loop"]))
    print("# wait_saved_pct: the wait saved against the inline run's (1 - wait / inline wait)")
    payload = {"benchmark": "alloc", "environment": env, "results": rows,
               "lifecycle": pages_rows, "published_a100": PUBLISHED_A100, "lock": lock,
               "mapper": mapper, "warnings": busy_warnings(env["load_1min"])}
    write_json(out, payload)
    return payload


def refuse_missing_cuda(parser, device: str | None) -> None:
    """``parser.error`` (one line, exit 2) for ``--device cuda`` when torch sees no GPU."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch here")


def main(argv=None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (seconds, not minutes)")
    parser.add_argument("--pages", type=POSITIVE_INT, default=None, help="pages mapped per repeat")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--out", default=None, type=result_file, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from vmemkv.vmem.errors import InsufficientMemoryError
    refuse_missing_cuda(parser, args.device)     # before the host section runs
    try:
        run(args.quick, args.out, args.pages, args.device)
    except InsufficientMemoryError as error:      # --pages the device cannot hold
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status("alloc", main))
