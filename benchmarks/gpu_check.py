"""The Python half of benchmarks/gpu_check.sh: the environment record, the GPU-test gate, the
digest, and a pytest plugin that writes each test's result the moment it finishes.

    python -m vmemkv.benchmarks.gpu_check env               versions of what the machine has
    python -m vmemkv.benchmarks.gpu_check gate OUT --expect gpu|skip
    python -m vmemkv.benchmarks.gpu_check digest OUT        appended to OUT/summary.txt
    pytest -p vmemkv.benchmarks.gpu_check ...               (GPU_CHECK_RESULTS=OUT/gpu_tests.jsonl)

Guarantees: the plugin appends one JSON line per test report as it happens ("start" before a
test runs, then its outcome with the skip reason), so a pytest process killed by a timeout keeps
every result before the kill and names the test it died in; ``GPU_CHECK_TEST_TIMEOUT`` seconds in
one test dump every thread's traceback and end the process (faulthandler, which a hung CUDA call
cannot block), so one hung test costs one test group, not the run (gpu_check.sh turns the
suite's own limit, pyproject's ``timeout``, off in its groups: this is their one).
``gate --expect gpu`` fails unless at least one GPU test passed, none failed, and none skipped
for a missing GPU or binding; ``--expect skip`` (the CPU dry run) fails unless every collected
GPU test skipped.
Nothing here imports CUDA bindings unless asked for their version.
"""
from __future__ import annotations

import faulthandler
import json
import os
import re
import sys
from pathlib import Path

RESULTS_ENV = "GPU_CHECK_RESULTS"
TEST_TIMEOUT_ENV = "GPU_CHECK_TEST_TIMEOUT"
# a skip that means this machine could not run GPU tests at all: tests/conftest.py's own marker
# ("GPU test: <why CUDA is unavailable>") and the bindings' messages; a test skipped for its own
# reason ("needs 2 CUDA devices", "needs 2 GPUs") does not fail the gate
MISSING_GPU = re.compile(r"^GPU test:|no cuda|cuda-python|cuda\.bindings|cuda driver unavailable", re.I)
VERSIONED = ("torch", "cuda.bindings", "transformers", "pytest", "hypothesis", "numpy",
             "matplotlib", "flash_attn", "pytest_timeout")


# -- pytest plugin --
_stderr = None      # the real stderr, kept before pytest captures fd 2 (tracebacks must show)


def pytest_configure(config):
    global _stderr
    if _stderr is None:
        _stderr = os.fdopen(os.dup(2), "w")


def _record(entry: dict) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(entry) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _record({"test": nodeid, "outcome": "start"})
    seconds = float(os.environ.get(TEST_TIMEOUT_ENV, "0") or 0)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr or sys.stderr)


def pytest_runtest_logfinish(nodeid, location):
    faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            reason = str(report.longrepr).splitlines()[-1][:300] if report.longrepr else ""
        outcome = "error" if report.failed and report.when != "call" else report.outcome
        _record({"test": report.nodeid, "outcome": outcome, "when": report.when, "reason": reason})


# -- reading the results --
def read_results(out: Path) -> dict:
    """{test: (outcome, reason)} from OUT/gpu_tests.jsonl; a test whose last line is "start"
    died there (timeout or crash) and counts as "died"."""
    results: dict = {}
    path = out / "gpu_tests.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue                      # a line cut short by a kill
            outcome = "died" if entry["outcome"] == "start" else entry["outcome"]
            if results.get(entry["test"], ("",))[0] in ("failed", "error") and outcome == "passed":
                continue                      # a teardown after a failed call stays failed
            results[entry["test"]] = (outcome, entry.get("reason", ""))
    return results


def count(results: dict) -> dict:
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped", "died")}
    for outcome, _ in results.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def gate_problems(results: dict, expect: str) -> list[str]:
    """Why the GPU tests do not count as run (``expect="gpu"``) or as all skipped cleanly
    (``expect="skip"``); empty when they do."""
    counts = count(results)
    bad = [f"{t}: {o} {r}".rstrip() for t, (o, r) in sorted(results.items())
           if o in ("failed", "error", "died")]
    if not results:
        return ["no GPU test results at all (nothing collected, or every process died first)"]
    if expect == "skip":
        if counts["skipped"] != len(results):
            bad.append(f"dry run: {len(results) - counts['skipped']} GPU tests did not skip")
        return bad
    missing = sorted({r for o, r in results.values() if o == "skipped" and MISSING_GPU.search(r)})
    bad += [f"skipped for a missing GPU or binding: {r}" for r in missing]
    if counts["passed"] == 0:
        bad.append("no GPU test passed")
    return bad


def gate(out: Path, expect: str) -> int:
    results = read_results(out)
    counts = count(results)
    print(f"{len(results)} GPU tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    problems = gate_problems(results, expect)
    for problem in problems:
        print("  GATE:", problem)
    print("gate:", "OK" if not problems else "FAILED", f"(expect {expect})")
    return 1 if problems else 0


# -- environment and digest --
def versions() -> dict:
    """Versions of the packages the run depends on ("missing: ..." when not importable)."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version
    found = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any import failure is the answer
            found[name] = f"missing: {type(error).__name__}"
            continue
        try:       # a module without __version__ (pytest_timeout): its distribution's
            found[name] = str(getattr(module, "__version__", None) or version(name.replace("_", "-")))
        except PackageNotFoundError:
            found[name] = "?"
    try:
        found["cuda.bindings"] = version("cuda-bindings")
    except PackageNotFoundError:
        pass
    return found


def digest(out: Path) -> None:
    """Test counts, skip reasons, failures, bench errors, attention ratios, smoke and profile
    verdicts, in a few lines."""
    results = read_results(out)
    counts = count(results)
    print("gpu tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    reasons: dict = {}
    for outcome, reason in results.values():
        if outcome == "skipped":
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  skipped x{n}: {reason}")
    for test, (outcome, reason) in sorted(results.items()):
        if outcome in ("failed", "error", "died"):
            print(f"  {outcome.upper()} {test} {reason}".rstrip())
    _digest_json(out)
    _digest_said(out)


def _digest_json(out: Path) -> None:
    for name in ("smoke", "profile"):
        try:
            payload = json.loads((out / f"{name}.json").read_text())
            print(f"{name}:", json.dumps(payload.get("verdicts", payload))[:600])
        except (OSError, ValueError) as error:
            print(f"{name}: no results:", error)
    try:
        bench = json.loads((out / "bench.json").read_text())
        sections = list(bench.get("sections", []))
        errors = {k: bench[k]["error"] for k in sections
                  if isinstance(bench.get(k), dict) and bench[k].get("error")}
        print("bench sections:", sections, " interrupted:", bench.get("interrupted"),
              " errors:", errors or "none", " warnings:", bench.get("warnings") or "none")
    except (OSError, ValueError) as error:
        print("bench: no results:", error)
    try:
        att = json.loads((out / "attention.json").read_text())
        print("attention backends:", att["environment"].get("backends"), " dtype:",
              att["environment"].get("dtype"))
        for r in att["speedups"]:
            print(f"  {r['phase']:7s} b{r['batch']:<3d} ctx{r['ctx']:<5d} paged/vmem {r['paged_over_vmem']:.2f}x")
    except (OSError, KeyError, ValueError) as error:
        print("attention: no results:", error)


def _digest_said(out: Path) -> None:
    said = set()
    log = out / "steps.log"
    for line in (log.read_text(errors="replace").splitlines() if log.exists() else []):
        m = re.search(r"(flash: .{0,160}|Error: .{0,160})", line)
        if m and m.group(0) not in said and len(said) < 20:
            said.add(m.group(0))
            print("  said:", m.group(0))


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["env"]:
        for key, value in versions().items():
            print(f"{key:16s} {value}")
        return 0
    if args[:1] == ["gate"] and len(args) == 4 and args[2] == "--expect":
        return gate(Path(args[1]), args[3])
    if args[:1] == ["digest"] and len(args) == 2:
        digest(Path(args[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
