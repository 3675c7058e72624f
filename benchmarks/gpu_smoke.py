"""gpu_check.sh's first and profile steps: the CUDA facts a first GPU run must establish before
anything else is worth measuring.

    python -m vmemkv.benchmarks.gpu_smoke smoke OUT/smoke.json [--dry-run]
    python -m vmemkv.benchmarks.gpu_smoke profile OUT/profile.json [--dry-run]

smoke (~20 s): cuda-bindings and driver versions; VMM support and granularity; that
``cuPointerGetAttribute(CONTEXT)`` of a torch tensor is the driver's context (vLLM once saw a
mismatch calling the driver through cuda-python); a page mapped from a fresh thread reads back
what torch wrote; an unmap right after a queued kernel (``torch.cuda._sleep``) that writes the
page does not fault, per page and after one ``prepare_unmap`` per plan.
profile: one short greedy generate per cache kind (vmem, paged) under torch.profiler and
``torch.cuda.set_sync_debug_mode("warn")``: FlashAttention kernels per layer per step (exactly
one on vmem) and host syncs per step.
Each check is recorded as {"name": {"ok": bool, ...}}; the exit status is 1 when any failed.
``--dry-run`` (the CPU) runs what needs no GPU (versions; the thread-map and unmap checks on
the host driver; the profile with sdpa on the CPU, counts reported, not judged).
"""
from __future__ import annotations

import json
import sys
import threading
import time

from vmemkv.scheduler.result_files import write_json


def _versions(cu) -> dict:
    from .gpu_check import versions
    found = versions()
    if cu is not None:
        err, v = cu.cuDriverGetVersion()
        found["cuda driver"] = f"{v // 1000}.{v % 1000 // 10}" if int(err) == 0 else str(err)
    return {"ok": True, **found}


def _vmm(driver) -> dict:
    cu = driver._cu
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    err, supported = cu.cuDeviceGetAttribute(attr, driver._cu_device)
    return {"ok": int(err) == 0 and bool(supported), "supported": int(supported),
            "granularity_bytes": driver.granularity_bytes}


def _context_matches(driver) -> dict:
    import torch
    cu = driver._cu
    probe = torch.empty(16, device=driver.device)
    err, ctx = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT,
                                        probe.data_ptr())
    return {"ok": int(err) == 0 and int(ctx) == int(driver._context),
            "tensor_context": hex(int(ctx)), "driver_context": hex(int(driver._context))}


def _map_from_thread(driver) -> dict:
    """Reserve and create here, map on a fresh thread, write and read with torch here."""
    page = driver.granularity_bytes
    address = driver.reserve(page)
    (handle,) = driver.create_pages(1, page)
    errors: list = []
    thread = threading.Thread(target=lambda: _catch(errors, driver.map, address, handle, page))
    thread.start()
    thread.join()
    ok = not errors
    if ok:
        view = driver.tensor(address, page)
        view.fill_(7)
        ok = int(view[page - 1]) == 7 and int(view.sum()) == 7 * page
        driver.unmap(address, page)
    driver.release_pages([handle])
    driver.free_reservation(address, page)
    return {"ok": ok, "errors": [repr(e) for e in errors]}


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as error:  # noqa: BLE001 - reported by the caller
        errors.append(error)


def _unmap_after_queued_kernel(driver, per_plan: bool) -> dict:
    """A long kernel, then a write to the page queued behind it, then unmap at once: the
    unmap must wait (it synchronises), so nothing faults when the stream is drained."""
    import torch
    page = driver.granularity_bytes
    address = driver.reserve(2 * page)
    handles = driver.create_pages(2, page)
    for i, handle in enumerate(handles):
        driver.map(address + i * page, handle, page)
    views = [driver.tensor(address + i * page, page) for i in range(2)]
    start = time.perf_counter()
    if driver.device.startswith("cuda"):
        torch.cuda._sleep(200_000_000)       # ~0.1-0.2 s of GPU time queued
    for view in views:
        view.fill_(3)
    if per_plan:
        driver.prepare_unmap(2)
    for i in range(2):
        driver.unmap(address + i * page, page)
    if driver.device.startswith("cuda"):
        torch.cuda.synchronize()             # a fault would surface here
    driver.release_pages(handles)
    driver.free_reservation(address, 2 * page)
    return {"ok": True, "unmap_wait_s": round(time.perf_counter() - start, 4)}


def smoke(dry_run: bool) -> dict:
    from vmemkv.vmem import open_driver
    checks: dict = {}
    if dry_run:
        checks["versions"] = _versions(None)
        driver = open_driver("host")
    else:
        driver = open_driver("cuda")
        checks["versions"] = _versions(driver._cu)
        checks["vmm"] = _run(_vmm, driver)
        checks["context"] = _run(_context_matches, driver)
    checks["map_from_thread"] = _run(_map_from_thread, driver)
    checks["unmap_after_kernel"] = _run(_unmap_after_queued_kernel, driver, False)
    checks["unmap_after_kernel_per_plan"] = _run(_unmap_after_queued_kernel, driver, True)
    driver.close()
    return checks


def _run(check, *args) -> dict:
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - a failed check is a result
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:400]}


def profile(dry_run: bool) -> dict:
    results = {}
    for cache in ("vmem", "paged"):
        results[cache] = _run(_profile_one, cache, dry_run)
    return results


def _profile_one(cache: str, dry_run: bool) -> dict:
    import warnings
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from vmemkv.runtime.engine import Engine, SamplingParams
    from vmemkv.runtime.models import build_model
    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.float16)
    attention = "sdpa" if dry_run else "flash"
    model = build_model("tiny-llama", seed=0, dtype=dtype, device=device)
    prompts = [[1 + (i * 7 + j) % 90 for j in range(8 + i)] for i in range(4)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(model, max_batch=4, max_context=64, cache=cache, attention=attention) as engine:
        engine.generate(prompts, params)                     # warm up (kernels, allocator)
        layers = engine.cache_config.num_layers
        activities = [ProfilerActivity.CPU] + ([] if dry_run else [ProfilerActivity.CUDA])
        with warnings.catch_warnings(record=True) as caught, torch_profile(activities=activities) as prof:
            warnings.simplefilter("always")
            if not dry_run:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(prompts, params)
            finally:
                if not dry_run:
                    torch.cuda.set_sync_debug_mode(0)
        steps = {"n": engine.last_stats.steps}
    names = [e.name for e in prof.events()]
    flash = sum("flash" in n.lower() and "kernel" in n.lower() and "combine" not in n.lower()
                for n in names)                      # split-KV's combine kernel is not a call
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    per_layer_step = flash / max(1, layers * steps["n"])
    ok = True if dry_run else (per_layer_step == 1.0 if cache == "vmem" else flash > 0)
    return {"ok": ok and (dry_run or syncs <= steps["n"] * 2), "steps": steps["n"], "layers": layers,
            "flash_kernels": flash, "flash_kernels_per_layer_step": round(per_layer_step, 3),
            "syncs": syncs, "syncs_per_step": round(syncs / max(1, steps["n"]), 2)}


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    if len(args) != 2 or args[0] not in ("smoke", "profile"):
        print(__doc__, file=sys.stderr)
        return 2
    checks = smoke(dry_run) if args[0] == "smoke" else profile(dry_run)
    verdicts = {name: bool(c.get("ok")) for name, c in checks.items()}
    write_json(args[1], {"dry_run": dry_run, "verdicts": verdicts, "checks": checks})
    for name, check in checks.items():
        print(f"{args[0]}: {name:30s} {'ok' if check.get('ok') else 'FAILED'}  {json.dumps(check)[:300]}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
