"""The head-to-head suite behind ``vmemkv bench``: "VMM or paged, and at what cost".

    vmemkv bench [--quick] [--out DIR] [--device cpu|cuda] [--only alloc attention ...]

Sections, in order, each a module with ``run(quick, out=None, ...) -> dict``:

| section   | module                 | answers                                                   |
|-----------|------------------------|-----------------------------------------------------------|
| alloc     | benchmarks/alloc.py    | map/unmap µs per page size; mapper wait with/without overlap |
| attention | benchmarks/attention.py| the yardsticks (read, copy bandwidth; matmul FLOP/s), then decode/prefill ms, GB/s, % of read bandwidth (decode) or matmul (prefill), vmem vs paged |
| memory    | benchmarks/memory.py   | utilisation and end waste vs block/page size and layout    |
| engine    | benchmarks/engine.py   | tokens/s of both layouts (and transformers' CB if present) |
| tp        | benchmarks/tp.py       | TP=1 vs TP=N tokens/s, communication share (only with ``--tp N``) |

Output in DIR: ``bench.json`` (every figure, one file), ``bench.log`` (what each section
printed), PNG plots (benchmarks/plots.py), each whole or not at all (scheduler/result_files.py:
bench.log grows as bench.log.partial; ``STALE.txt`` names the files an unfinished or cut-short
run left from an earlier one). A progress bar runs on stderr while it works; an
aligned summary table is printed at the end. A section that fails or cannot run is recorded
with the reason and the others still run.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import platform
import sys
import time
import traceback
from typing import Callable, Optional

from vmemkv.benchmarks.summary import busy_warning, format_summary, summary_rows  # noqa: F401 (re-export)
from vmemkv.scheduler.cliargs import hold_point
from vmemkv.scheduler.result_files import StaleMarker, streamed_open, write_json

# what a run owns in its folder, by exact name: its plots (plots.write_all's) and
# --prefix-eviction's prefix.json, not ``vmemkv bench serve``'s serve.json and serve.png
# ("*.png" called serve.png stale after every bench run, and missed prefix.json)
OUTPUTS = ("bench.json", "bench.log", "prefix.json", "attention_latency.png",
           "memory_utilisation.png", "mapper_overlap.png")

SECTIONS = ("alloc", "attention", "memory", "engine")
SMOKE = False   # smoke.apply sets it: bench.json's environment then says the sizes were toy ones


def versions(device_type: str = "cpu") -> dict:
    """Driver and library versions every benchmark prints beside the device."""
    import torch
    out = {"kernel": platform.release(), "vmem_driver": "cuda" if device_type == "cuda" else "host",
           "load_1min": round(os.getloadavg()[0], 2)}   # >= cores / 2: timings shared the CPU
    if device_type == "cuda":
        out["cuda_runtime"] = torch.version.cuda
        out["cuda_driver"] = _cuda_driver_version()
        out["cuda_python"] = _package_version("cuda-python") or _package_version("cuda-bindings")
    return out


def _cuda_driver_version() -> Optional[str]:
    try:
        from cuda.bindings import driver as cu
        err, version = cu.cuDriverGetVersion()
        return f"{int(version) // 1000}.{int(version) % 1000 // 10}" if int(err) == 0 else None
    except Exception:  # noqa: BLE001 -- a version string is informative, never required
        return None


def _package_version(name: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# -- the progress bar: tqdm when importable, else one stderr line per unit --
class Progress:
    """``tick(label)`` advances one unit; ``write(text)`` prints above the bar."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.count, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc="vmemkv bench", file=sys.stderr, unit="cfg",
                                 dynamic_ncols=True)
            except ImportError:
                pass

    def tick(self, label: str) -> None:
        self.count += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label[:40], refresh=False)
            self._bar.update(1)
        elif self.enabled:
            sys.stderr.write(f"[{self.count}/{self.total}] {label}\n")
            sys.stderr.flush()

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text.rstrip("\n"), file=sys.stdout)
        else:
            print(text.rstrip("\n"), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# -- sections --
def _units(section: str, quick: bool, device: str) -> int:
    """Progress units a section will tick (estimates for modules that tick per configuration)."""
    if section == "attention":
        from vmemkv.benchmarks import attention
        return attention.num_configs(attention.parse_args((["--quick"] if quick else []) + ["--device", device]))
    if section == "memory":
        from vmemkv.benchmarks import memory
        return len(memory.configs(quick))
    if section == "alloc":
        from vmemkv.benchmarks import alloc
        return alloc.num_configs(quick)
    return 1


def load_engine() -> tuple[Optional[Callable], Optional[str]]:
    """(benchmarks.engine.run, None) when importable and exposing run, else (None, why not)."""
    try:
        module = importlib.import_module("vmemkv.benchmarks.engine")
    except Exception as error:  # noqa: BLE001 -- any import failure is a reason to skip
        return None, f"vmemkv.benchmarks.engine is not importable ({type(error).__name__}: {error})"
    run = getattr(module, "run", None)
    if not callable(run):
        return None, "vmemkv.benchmarks.engine has no run(quick, out, device) function"
    return run, None


def _call(section: str, quick: bool, device: str, progress: Progress,
          options: Optional[dict] = None) -> dict:
    """Run ``section``; ``options``: keyword arguments per section name ("tp": tp.run's world,
    tp_devices; "engine": engine.run's kv_cache_dtype)."""
    mine = (options or {}).get(section, {})
    if section == "tp":
        from vmemkv.benchmarks import tp
        return tp.run(quick=quick, out=None, device=device, **mine)
    if section == "engine":
        run, why = load_engine()
        if run is None:
            print(f"# engine section skipped: {why}")
            return {"skipped": why}
        return run(quick=quick, out=None, device=device, **mine)
    module = importlib.import_module(f"vmemkv.benchmarks.{section}")
    return module.run(quick=quick, out=None, device=device, progress=progress.tick)


def run_section(section: str, quick: bool, device: str, progress: Progress, log,
                options: Optional[dict] = None) -> dict:
    """Run one section with its stdout captured (then shown above the bar and logged)."""
    import torch
    buffer, start = io.StringIO(), time.perf_counter()
    before, threads = progress.count, torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(buffer):
            payload = _call(section, quick, device, progress, options)
    except Exception as error:  # noqa: BLE001 -- a failed section must not lose the others
        buffer.write(traceback.format_exc())
        payload = {"error": f"{type(error).__name__}: {error}"}
    finally:
        torch.set_num_threads(threads)   # a section may change it (engine: 1 thread)
    for _ in range(_units(section, quick, device) - (progress.count - before)):
        progress.tick(section)
    payload = dict(payload or {})
    payload["wall_s"] = time.perf_counter() - start
    text = f"== {section} ({payload['wall_s']:.1f} s)\n{buffer.getvalue()}"
    progress.write(text)
    log.write(text + "\n")
    return payload


def run_suite(quick: bool = False, out_dir: str = "bench_out", device: Optional[str] = None,
              sections=SECTIONS, plots: bool = True, progress: bool = True,
              options: Optional[dict] = None) -> dict:
    """Run ``sections`` (``options``: keyword arguments per section, see ``_call``); write
    ``out_dir``/bench.json, bench.log and PNGs; return the payload.
    Ctrl-C (KeyboardInterrupt) stops it between or inside sections: bench.json and bench.log
    then hold the sections that finished (``payload["interrupted"]`` is true), no plots are
    drawn, and the interrupt goes on up with a note naming what was written."""
    import torch
    from vmemkv.benchmarks.common import environment
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    marker = StaleMarker(out_dir, OUTPUTS, "vmemkv bench").begin()
    try:        # an error (a full disk) ends the run: STALE.txt says so (Ctrl-C: below)
        bar = Progress(sum(_units(s, quick, device) for s in sections), enabled=progress)
        start = time.perf_counter()
        env = environment(seed=0, warmup=None, repeats=None, device=device, **versions(device),
                          quick=quick, smoke=SMOKE)
        env["warmup"] = env["repeats"] = "per section (see each section's environment)"
        payload = {"benchmark": "vmemkv bench", "environment": env, "sections": list(sections),
                   "interrupted": False}
        try:
            _run_sections(payload, sections, quick, device, bar, out_dir, options)
        except KeyboardInterrupt:
            payload["interrupted"] = True
        finally:
            bar.close()
        marker.wrote(os.path.join(out_dir, "bench.log"))   # in place, whole, however it ended
        payload["wall_s"] = time.perf_counter() - start
        payload["plots"] = []
        if plots and not payload["interrupted"]:
            try:          # a Ctrl-C while plotting still writes bench.json, every section in it,
                # and the plots already rewritten (each recorded as it is written, not at the end)
                _plots(payload, out_dir, lambda path: payload["plots"].append(marker.wrote(path)))
            except KeyboardInterrupt:
                payload["interrupted"] = True
        marker.wrote(_finish(payload, sections, out_dir))
    except Exception as error:
        marker.failed(error)
        raise
    marker.finish("interrupted" if payload["interrupted"] else None)
    if payload["interrupted"]:
        done = [s for s in sections if s in payload]
        raise KeyboardInterrupt(f"wrote {payload['json']} and bench.log with the sections that "
                                f"finished: {', '.join(done) or 'none'}")
    return payload


def _run_sections(payload: dict, sections, quick: bool, device: str, bar: Progress,
                  out_dir: str, options: Optional[dict] = None) -> None:
    """Each section in turn, its output appended (and flushed) to bench.log as it finishes."""
    with streamed_open(os.path.join(out_dir, "bench.log")) as log:
        for section in sections:
            hold_point(f"bench:{section}")
            payload[section] = run_section(section, quick, device, bar, log, options)
            log.flush()


def _finish(payload: dict, sections, out_dir: str) -> str:
    """The summary rows, the warnings (busy machine: the load at the start or the end >= half
    the cores; attention rows above 100% of their run's measured read) and bench.json; sets
    ``payload["json"]`` and returns it."""
    from vmemkv.benchmarks.attention_goals import run_warnings
    payload["summary"] = summary_rows(payload, sections)
    load = max(payload["environment"].get("load_1min", 0.0), os.getloadavg()[0])
    payload["warnings"] = run_warnings((payload.get("attention") or {}).get("results", []), load)
    payload["json"] = write_json(os.path.join(out_dir, "bench.json"), payload, default=str)
    return payload["json"]


def _plots(payload: dict, out_dir: str, on_written: Callable[[str], None]) -> None:
    """The PNGs (plots.write_all), ``on_written(path)`` as each is in place; without
    matplotlib, one line naming the bench extra (``missing_extra``), and the run goes on."""
    from vmemkv.cli import missing_extra
    try:
        from vmemkv.benchmarks import plots
        plots.write_all(payload, out_dir, on_written)
    except ImportError as error:
        print(f"# plots skipped: {missing_extra(error) or error}")
