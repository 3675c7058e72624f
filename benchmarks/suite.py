"""The head-to-head suite behind ``vmemkv bench``: "VMM or paged, and at what cost".

    vmemkv bench [--quick] [--out DIR] [--device cpu|cuda] [--only alloc attention ...]

Sections, in order, each a module with ``run(quick, out=None, ...) -> dict``:

| section   | module                 | answers                                                   |
|-----------|------------------------|-----------------------------------------------------------|
| alloc     | benchmarks/alloc.py    | map/unmap µs per page size; mapper wait with/without overlap |
| attention | benchmarks/attention.py| decode/prefill ms, GB/s, % of copy bandwidth, vmem vs paged |
| memory    | benchmarks/memory.py   | utilisation and end waste vs block/page size and layout    |
| engine    | benchmarks/engine.py   | tokens/s of both layouts (and transformers' CB if present) |

Output in DIR: ``bench.json`` (every figure, one file), ``bench.log`` (what each section
printed), PNG plots (benchmarks/plots.py). A progress bar runs on stderr while it works; an
aligned summary table is printed at the end. A section that fails or cannot run is recorded
with the reason and the others still run.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import platform
import sys
import time
import traceback
from typing import Callable, Optional

SECTIONS = ("alloc", "attention", "memory", "engine")


def versions(device_type: str = "cpu") -> dict:
    """Driver and library versions every benchmark prints beside the device."""
    import torch
    out = {"kernel": platform.release(), "vmem_driver": "cuda" if device_type == "cuda" else "host",
           "load_1min": round(os.getloadavg()[0], 2)}   # > cores: timings shared the CPU
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


def _call(section: str, quick: bool, device: str, progress: Progress) -> dict:
    if section == "engine":
        run, why = load_engine()
        if run is None:
            print(f"# engine section skipped: {why}")
            return {"skipped": why}
        return run(quick=quick, out=None, device=device)
    module = importlib.import_module(f"vmemkv.benchmarks.{section}")
    return module.run(quick=quick, out=None, device=device, progress=progress.tick)


def run_section(section: str, quick: bool, device: str, progress: Progress, log) -> dict:
    """Run one section with its stdout captured (then shown above the bar and logged)."""
    import torch
    buffer, start = io.StringIO(), time.perf_counter()
    before, threads = progress.count, torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(buffer):
            payload = _call(section, quick, device, progress)
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
              sections=SECTIONS, plots: bool = True, progress: bool = True) -> dict:
    """Run ``sections``; write ``out_dir``/bench.json, bench.log and PNGs; return the payload."""
    import torch
    from vmemkv.benchmarks.common import environment
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(out_dir, exist_ok=True)
    total = sum(_units(s, quick, device) for s in sections)
    bar = Progress(total, enabled=progress)
    start = time.perf_counter()
    env = environment(seed=0, warmup=None, repeats=None, device=device, **versions(device), quick=quick)
    env["warmup"] = env["repeats"] = "per section (see each section's environment)"
    payload = {"benchmark": "vmemkv bench", "environment": env, "sections": list(sections)}
    with open(os.path.join(out_dir, "bench.log"), "w") as log:
        for section in sections:
            payload[section] = run_section(section, quick, device, bar, log)
    bar.close()
    payload["wall_s"] = time.perf_counter() - start
    payload["plots"] = _plots(payload, out_dir) if plots else []
    payload["summary"] = summary_rows(payload)
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    payload["json"] = path
    return payload


def _plots(payload: dict, out_dir: str) -> list[str]:
    try:
        from vmemkv.benchmarks import plots
        return plots.write_all(payload, out_dir)
    except ImportError as error:
        print(f"# plots skipped: {error}")
        return []


# -- the summary table --
def summary_rows(payload: dict) -> list[dict]:
    """One row per headline figure: section | what | vmem | paged | unit | note."""
    rows = []
    for section in SECTIONS:
        data = payload.get(section)
        if data is None:
            continue
        if "error" in data or "skipped" in data:
            rows.append({"section": section, "what": "not run", "note": data.get("error") or data["skipped"]})
            continue
        rows.extend(dict(section=section, **r) for r in _SUMMARISERS[section](data))
    return rows


def _alloc_summary(data: dict) -> list[dict]:
    rows = [{"what": f"{r['driver']} map+unmap {r['page_size']}", "vmem": r["map_unmap_us"],
             "unit": "µs/page"} for r in data.get("results", [])]
    for r in data.get("mapper", []):
        rows.append({"what": f"mapper wait, {r['mode']}", "vmem": r["wait_ms"], "unit": "ms",
                     "note": f"of {r['mapping_ms']:.1f} ms mapping, {r['steps']} steps"})
    return rows


def _attention_summary(data: dict) -> list[dict]:
    by_key = {(r["phase"], r["batch"], r["ctx"], r["cache"]): r for r in data["results"]}
    rows = []
    for (phase, batch, ctx, kind), r in by_key.items():
        paged = by_key.get((phase, batch, ctx, "paged"))
        if kind != "vmem" or paged is None:
            continue
        rows.append({"what": f"{phase} b{batch} ctx{ctx}", "vmem": r["ms"], "paged": paged["ms"],
                     "unit": "ms", "note": f"paged/vmem {paged['ms'] / r['ms']:.2f}x; "
                     f"{r['pct_copy']:.0f}% vs {paged['pct_copy']:.0f}% of copy bw"})
    return rows


def _memory_summary(data: dict) -> list[dict]:
    rows = []
    for r in data["results"]:
        column = "paged" if r["policy"] == "paged" else "vmem"
        rows.append({"what": f"held util {r['label']} ({r['tokens_per_unit']} tok)", column:
                     100 * r["held_utilization"], "unit": "%",
                     "note": f"end waste {r['mean_end_waste_tokens']:.1f} tok/seq"})
    return rows


def _engine_summary(data: dict) -> list[dict]:
    """tokens/s per system; vmem systems in the vmem column, paged ones (ours, transformers') in paged."""
    rows = []
    for r in data.get("rows") or data.get("results") or []:
        label = str(r.get("system") or r.get("engine") or r.get("name") or "engine")
        value = r.get("tok_s", r.get("tokens_per_s"))
        if value is None:
            continue
        note = [f"{k} {r[k]:.1%}" for k in ("map_share",) if isinstance(r.get(k), float)]
        note += [f"{r['vs_hf']:.2f}x transformers"] if isinstance(r.get("vs_hf"), float) else []
        column = "vmem" if "vmem" in label else "paged"
        rows.append({"what": f"engine {label}", column: float(value), "unit": "tok/s",
                     "note": "; ".join(note)})
    return rows or [{"what": "engine", "note": "no tokens/s figures; see bench.json"}]


_SUMMARISERS = {"alloc": _alloc_summary, "attention": _attention_summary,
                "memory": _memory_summary, "engine": _engine_summary}


SUMMARY_COLUMNS = ("section", "what", "vmem", "paged", "unit", "note")


def format_summary(rows: list[dict]) -> str:
    """Aligned table: numbers right-aligned (3 decimals), text left-aligned."""
    def cell(value):
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    numeric = {"vmem", "paged"}
    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in SUMMARY_COLUMNS]

    def line(values):
        return " | ".join(v.rjust(w) if c in numeric else v.ljust(w)
                          for c, v, w in zip(SUMMARY_COLUMNS, values, widths)).rstrip()
    out = [line(SUMMARY_COLUMNS), "-+-".join("-" * w for w in widths)]
    out.extend(line([cell(r.get(c, "")) for c in SUMMARY_COLUMNS]) for r in rows)
    return "\n".join(out)
