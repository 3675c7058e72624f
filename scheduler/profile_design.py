"""Which coefficients of a device profile its timed steps determine (numpy, no torch).

A calibration's design points (``profile_fit.DesignPoints.rows``: each step composition's terms,
``profile_cost.step_features``) determine a coefficient only when no other mix of the
coefficients gives the same seconds at every one of them: its unit vector lies in the rows'
span. A grid of one batch (``vmemkv calibrate --batches 1``: sequences always 1, as the base
term's 1) cannot tell ``per_seq_s`` from ``base_s``; one without single prompts
(``--prefill-lengths`` empty) never wakes from idle, so nothing measures ``per_idle_wake_s``.
The fit still returns a split (non-negative least squares picks one) and its bootstrap an
interval of zero width around it: both looked measured, and a simulation whose steps differ
from those timed charged the arbitrary split. ``undetermined`` names them; the profile's
intervals for them are null and calibrate warns (``undetermined_message``).

``check_steps``: the timed steps a fit is given (a profile's ``points``, hand-edited or saved by
a benchmark) checked field by field, each refused by name (a string batch was read as its
number, a cold_step of 5 charged five cold steps, a missing field was a KeyError).
"""
from __future__ import annotations

from typing import List

import numpy as np

from .errors import ConfigError
from .field_checks import check_int, check_number
from .profile_cost import FITTED

STEP_FIELDS = (("batch", 1), ("new_tokens", 1), ("context_tokens", 0))   # a step's, required
OPTIONAL_FIELDS = (("prefill_pairs", 0), ("shape", 0), ("repeat", 0))    # a version 1 point's
FLAGS = ("cold_step", "after_idle")                                      # lack them: 0

NULL_TOLERANCE = 1e-8    # a null-space vector's weight on a coefficient that counts (exact
                         # collinearity gives O(1) weights; the SVD's round-off ~1e-15)


def undetermined(rows: np.ndarray) -> List[str]:
    """The coefficients (``FITTED`` order) that the design points ``rows`` (D x len(FITTED))
    leave undetermined: those a direction of the rows' null space moves (columns scaled to unit
    size first, rank as numpy's ``matrix_rank`` counts it)."""
    rows = np.asarray(rows, dtype=float).reshape(-1, len(FITTED))
    scaled = rows / np.maximum(abs(rows).max(axis=0, initial=0.0), 1e-300)
    _, s, vt = np.linalg.svd(scaled)            # vt: len(FITTED) x len(FITTED)
    tol = (s.max() if s.size else 0.0) * max(scaled.shape) * np.finfo(float).eps
    null = vt[int((s > tol).sum()):]
    return [name for j, name in enumerate(FITTED) if abs(null[:, j]).max(initial=0.0)
            > NULL_TOLERANCE]


def undetermined_message(names: List[str]) -> str:
    """calibrate's warning for coefficients the timed steps leave ``undetermined``."""
    one = len(names) == 1
    it, its = ("it", "its") if one else ("them", "their")
    return (f"the timed steps do not determine {', '.join(names)}: no design point tells {it} "
            f"apart from the other terms, so {its} fitted value{'' if one else 's'} "
            f"{'is' if one else 'are'} arbitrary ({its} interval{'' if one else 's'} null) and "
            f"a simulation whose steps differ from those timed charges {it} unmeasured; time "
            f"more --batches, --contexts and --prefill-lengths (the defaults determine every "
            f"coefficient)")


def check_steps(points) -> None:
    """ConfigError naming the first of ``points`` (timed steps) that is not an object with
    ``STEP_FIELDS`` ints, ``seconds`` a finite number > 0, and each of ``OPTIONAL_FIELDS`` an
    int and ``FLAGS`` 0 or 1 where given; or naming ``points`` when it is no list of them."""
    if not isinstance(points, (list, tuple)) or not points:
        raise ConfigError("a device profile's fit needs timed steps: points is empty"
                          if isinstance(points, (list, tuple)) else
                          f"points must be a list of timed steps, got {points!r}")
    for i, p in enumerate(points):
        if not isinstance(p, dict) or any(k not in p for k, _ in STEP_FIELDS + (("seconds", 0),)):
            raise ConfigError(f"points[{i}] must be a timed step, an object with "
                              f"{', '.join(k for k, _ in STEP_FIELDS)} and seconds, got {p!r}")
        check_number(f"points[{i}].seconds", p["seconds"], unit="seconds", inclusive=False)
        for key, least in STEP_FIELDS + tuple(f for f in OPTIONAL_FIELDS if f[0] in p):
            check_int(f"points[{i}].{key}", p[key], least)
        for key in FLAGS:
            if p.get(key, 0) not in (0, 1) or isinstance(p.get(key), (bool, float)):
                raise ConfigError(f"points[{i}].{key} must be 0 or 1, got {p[key]!r}")
