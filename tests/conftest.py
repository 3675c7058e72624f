"""Shared test set-up: GPU tests skip cleanly without CUDA; hypothesis profiles; the cyclic
garbage collector tuned for a long test session.

Profiles: ``ci`` (default, a few hundred examples per state machine, fits CI's budget) and
``long`` (for local soak runs: ``HYPOTHESIS_PROFILE=long pytest``).
"""
import gc
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None, max_examples=5000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Test tensors are tiny: one intra-op thread avoids OpenMP spin-waits that make each small op
# cost milliseconds on a loaded 2-core machine (CI's size). Benchmarks are not affected.
try:
    import torch
    torch.set_num_threads(1)
except ImportError:  # the scheduler tests need no torch
    pass


# The suite's one process holds ~400k objects once collection has imported torch, transformers,
# hypothesis and every test module, ~600k by its end. At CPython's default thresholds (700, 10,
# 10) the allocation-heavy tests (the simulator's, the state machines') set off full collections
# that walk all of them: 24 s of tests/scheduler + tests/hf's 134 s was the collector. Young
# objects are collected every 50,000 allocations instead, and what collection left (it lives all
# session) is frozen out of the full passes (pytest_collection_finish). Reference counting frees
# everything as before; a test that needs cyclic garbage gone calls gc.collect(), as they do.
gc.set_threshold(50_000, 20, 20)


def _cuda_skip_reason():
    from vmemkv.vmem.cuda import cuda_unavailable_reason
    return cuda_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    from .bench.gpu_check_dry_runs import run_order
    items.sort(key=run_order)     # stable: tests/distributed, then the gpu_check dry-run tests last
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or _cuda_skip_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


def pytest_collection_finish(session):
    """Freeze what collection left out of the collector's full passes; start benchmarks/
    gpu_check.sh's dry runs in the background when their tests are selected: they overlap the
    rest of the suite on the core it leaves idle (tests/bench/gpu_check_dry_runs.py)."""
    from .bench.gpu_check_dry_runs import start_if_selected
    gc.collect()
    gc.freeze()
    start_if_selected(session)


def pytest_unconfigure(config):
    from .bench.gpu_check_dry_runs import stop
    stop(config)
