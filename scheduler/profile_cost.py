"""A measured cost model: step seconds fitted to the real engine's steps on one machine.

``vmemkv calibrate`` times the engine's steps and fits

    step seconds = base_s + per_seq_s * sequences + per_new_token_s * new tokens
                   + per_context_token_s * context tokens
                   + per_prefill_pair_s * prefill pairs + per_step_token_sq_s * new tokens²
                   + per_prefill_step_s * prefill + per_cold_step_s * cold
                   + per_idle_wake_s * after idle + mapped pages * map latency

(context tokens: KV read, summed over the step's sequences, as in the roofline. Prefill pairs:
``cost.prefill_pairs``, attention's query-key pairs beyond one per context token, zero in a
decode, L * (L - 1) / 2 for a whole prompt of L tokens: prefill's quadratic part in each
sequence. New tokens²: a step's per-token cost grows with its tokens (their activations leave
the CPU caches: 67-73 -> 96-98 us per token from 256- to 2,048-token steps here). Prefill: 1 for
a step with prefill pairs (its prompts take the per-request SDPA path). After idle: 1 for the
first step after the engine had nothing to run (a woken CPU, cold caches: prefills measured 20%
slower after idle than back to back). Cold: 1 for the first ``cost.COLD_STEPS`` decode-only
steps after a prefill, ``cost.AfterPrefill``.) by a robust fit on the median of each design
point's repeats (``profile_fit``), and writes a device profile, JSON:

    {"format": "vmemkv-device-profile", "version": 4,
     "model": {"name": "small-llama", "num_layers": 4, "num_kv_heads": 2, "head_dim": 32,
               "dtype_bytes": 4, "weight_bytes": 6291456,
               "layer_windows": [null, null, null, null]},   # version 4: per layer, the
                                                   # sliding window in tokens, or null (full)
     "engine": {"cache": "vmem", "layout": "per-layer", "page_bytes": 65536, "max_batch": 16,
                "max_context": 512, "max_tokens_per_step": 2048},  # the engine timed
     "device": "cpu: <processor>, 1 threads",
     "coefficients": {"base_s": ..., "per_seq_s": ..., "per_new_token_s": ...,
                      "per_context_token_s": ..., "per_prefill_pair_s": ...,
                      "per_step_token_sq_s": ..., "per_prefill_step_s": ...,
                      "per_cold_step_s": ..., "per_idle_wake_s": ...},
     "coefficient_intervals": {"base_s": [lo, hi], ...},   # version 3: 95% intervals (null:
                                   # too few repeats to resample, or one of fit's undetermined)
     "calibration": {"precision": 0.05, "repeats": ..., "noise": {...}, ...},   # version 3
     "points": [{"batch": 4, "context_tokens": 1030, "new_tokens": 4, "prefill_pairs": 0,
                 "cold_step": 1, "after_idle": 0, "shape": 3, "repeat": 0, "seconds": ...}, ...],
     "fit": {"median_rel_error": ..., "max_rel_error": ...,
             "undetermined": [...]}}   # the coefficients no design point tells apart
                                       # (profile_design; absent before this field: unknown)

``vmemkv simulate --profile FILE`` (``SimConfig.profile``) uses it in place of the roofline;
the profile's model is the model the simulation's managers size memory for, and its ``engine``
the settings ``vmemkv simulate --profile`` defaults to (``profile_engine``). A profile written
before the ``OPTIONAL_COEFFICIENTS`` existed (version 1) loads with them 0: prefill cost linear
in tokens, every decode warm; version 2 and 3 files load with the ones they lack 0 as well
(calibrate added them one at a time); version 4 must have them all (one missing is refused by
name); a coefficient no version has is refused by name in every version. Version 3 adds the coefficients' intervals, the calibration's
repeats and noise check (``profile_fit``), each point's shape and repeat, and its ``fit`` errors
are over the design points' medians (version 2: over every timed step); version 4 adds the
model's ``layer_windows`` (versions 1-3: every layer full attention, unless given). A version
this code does not know (``READABLE_VERSIONS``) is refused by name. A coefficient must be a
finite number in [0, ``MAX_COEFFICIENT_S``): seconds per unit of its term. An ``engine``
setting no calibrate writes (``ENGINE_KEYS``: a misspelling) is refused by name, as is a
``layer_windows`` that is not a list, an engine no engine runs (``max_context`` below 2,
``max_tokens_per_step`` below ``max_batch``), a model entry that is not an object or whose name
is not a string, a version that is not an int (4.0), and a path that is not a regular file (a
FIFO was waited on for ever; simulate reads a profile twice, which a pipe cannot give).
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Dict

from .errors import ConfigError
from .field_checks import file_name
from .geometry import LAYOUT_CHOICES
from .presets import ModelSpec

PROFILE_FORMAT = "vmemkv-device-profile"
PROFILE_VERSION = 4                 # what vmemkv calibrate writes
READABLE_VERSIONS = (1, 2, 3, 4)    # what load_profile reads
WINDOWS_VERSION = 4                 # the first whose model entry must have layer_windows
ALL_COEFFICIENTS_VERSION = 4        # the first that must have every coefficient
COEFFICIENTS = ("base_s", "per_seq_s", "per_new_token_s", "per_context_token_s")
OPTIONAL_COEFFICIENTS = ("per_prefill_pair_s", "per_step_token_sq_s",   # 0 where a (version 1)
                         "per_prefill_step_s", "per_cold_step_s",        # profile lacks them
                         "per_idle_wake_s")
FITTED = COEFFICIENTS + OPTIONAL_COEFFICIENTS
MAX_COEFFICIENT_S = 3600.0          # an hour per unit of a term: no step measured costs that
ENGINE_CACHES = ("vmem", "paged")
ENGINE_COUNTS = ("max_batch", "max_context", "max_tokens_per_step")
ENGINE_KEYS = ("cache", "layout", "page_bytes") + ENGINE_COUNTS   # what calibrate writes
# each coefficient's unit in profile_summary, and its value in that unit per second
UNITS = {"base_s": ("ms", 1e3), "per_seq_s": ("us", 1e6), "per_new_token_s": ("us", 1e6),
         "per_context_token_s": ("ns", 1e9), "per_prefill_pair_s": ("ns", 1e9),
         "per_step_token_sq_s": ("ns", 1e9), "per_prefill_step_s": ("ms", 1e3),
         "per_cold_step_s": ("ms", 1e3), "per_idle_wake_s": ("ms", 1e3)}
ENGINE_COUNT_MAX = {"max_batch": 10**7, "max_context": 10**7, "max_tokens_per_step": 10**9,
                    "page_bytes": 2**40}     # vmemkv sweep's limits on the same settings


@dataclass(frozen=True)
class ProfileCost:
    """The fitted step cost; the same ``step_seconds`` / ``pages_per_map_op`` as CostModel."""
    base_s: float
    per_seq_s: float
    per_new_token_s: float
    per_context_token_s: float
    per_prefill_pair_s: float = 0.0
    per_step_token_sq_s: float = 0.0
    per_prefill_step_s: float = 0.0
    per_cold_step_s: float = 0.0
    per_idle_wake_s: float = 0.0
    map_latency_s: float = 0.0
    pages_per_map_op: int = 1

    def __post_init__(self) -> None:
        for name in FITTED + ("map_latency_s",):
            value = getattr(self, name)
            top = MAX_COEFFICIENT_S if name in FITTED else math.inf
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < top:
                raise ConfigError(f"profile coefficient {name} must be a number in [0, "
                                  f"{top:g}) seconds, got {value!r}")

    def step_seconds(self, context_tokens: int, new_tokens: int, mapped_pages: int = 0,
                     num_seqs: int = 0, prefill_pairs: int = 0, cold_step: bool = False,
                     after_idle: bool = False) -> float:
        """Seconds of a step of ``num_seqs`` sequences reading ``context_tokens`` of KV and
        computing ``new_tokens`` with ``prefill_pairs`` (``cost.prefill_pairs``) attention
        pairs beyond one per context token, after mapping ``mapped_pages`` pages; a step with
        prefill pairs costs ``per_prefill_step_s`` more, a ``cold_step``
        (``cost.AfterPrefill``) ``per_cold_step_s`` more, and the first step ``after_idle``
        ``per_idle_wake_s`` more."""
        return (self.base_s + self.per_seq_s * num_seqs + self.per_new_token_s * new_tokens
                + self.per_context_token_s * context_tokens
                + self.per_prefill_pair_s * prefill_pairs
                + self.per_step_token_sq_s * new_tokens * new_tokens
                + self.per_prefill_step_s * (prefill_pairs > 0) + self.per_cold_step_s * cold_step
                + self.per_idle_wake_s * after_idle
                + mapped_pages * self.map_latency_s)


def step_features(batch: int, new_tokens: int, context_tokens: int, prefill_pairs: int = 0,
                  cold_step: bool = False, after_idle: bool = False) -> tuple:
    """The terms ``step_seconds`` multiplies by each coefficient, in ``FITTED``'s order: a
    step's row in the fit (``step_seconds`` = coefficients . row, without map latency)."""
    return (1.0, float(batch), float(new_tokens), float(context_tokens), float(prefill_pairs),
            float(new_tokens) * new_tokens, float(prefill_pairs > 0), float(cold_step),
            float(after_idle))


def load_profile(path: str) -> Dict:
    """The profile at ``path`` (a str or os.PathLike file name), checked; ConfigError naming
    the file and what is wrong."""
    name = file_name(path)
    if name is None:                   # open(3) read, then closed, the caller's descriptor
        raise ConfigError(f"device profile must be a file name (str or os.PathLike), got "
                          f"{path!r}")
    try:
        profile = json.loads(read_regular(name))
    except (OSError, ValueError, RecursionError) as error:   # bad JSON, or nested too deep
        why = "nested too deeply" if isinstance(error, RecursionError) else error
        raise ConfigError(f"device profile {path}: {why}") from None
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"device profile {path}: not a {PROFILE_FORMAT} file (write one with "
                          f"vmemkv calibrate)")
    version = profile.get("version", 1)
    if type(version) is not int or version not in READABLE_VERSIONS:     # 4.0 passed as 4
        raise ConfigError(f"device profile {path}: version {version!r} is not one this vmemkv "
                          f"reads ({', '.join(map(str, READABLE_VERSIONS))}): rerun vmemkv "
                          f"calibrate, or use the vmemkv that wrote it")
    coeffs = profile.get("coefficients")
    if not isinstance(coeffs, dict):
        raise ConfigError(f"device profile {path}: coefficients must be an object of "
                          f"{', '.join(FITTED)}")
    # versions 1-3 load as they always did: what they lack is 0 (calibrates of version 2 wrote
    # some of the optional ones, as they were added); version 4 (today's calibrate) has them all
    required = FITTED if version >= ALL_COEFFICIENTS_VERSION else COEFFICIENTS
    missing = [k for k in required if k not in coeffs]
    unknown = sorted(map(repr, set(coeffs) - set(FITTED)))
    if missing or unknown:
        raise ConfigError(f"device profile {path}: version {version} coefficients must have "
                          f"{', '.join(required)}" + (f"; missing {', '.join(missing)}" if missing
                                                      else f"; unknown {', '.join(unknown)}"))
    try:
        ProfileCost(**fitted_coefficients(coeffs))
    except ConfigError as error:
        raise ConfigError(f"device profile {path}: {error}") from None
    profile_model(profile, path)
    profile_engine(profile, path)
    return profile


def profile_model(profile: Dict, path: str = "profile") -> ModelSpec:
    """The ModelSpec the profile was measured on (``layer_windows`` from a JSON list)."""
    try:
        if not isinstance(profile["model"], dict):   # a list was "cannot convert dictionary
            raise TypeError(f"model must be an object, got {profile['model']!r}")  # update..."
        entry = dict(profile["model"])
        if not isinstance(entry.get("name"), str) or not entry.get("name"):
            raise TypeError(f"model name must be a non-empty string, got {entry.get('name')!r}")
        if profile.get("version", 1) >= WINDOWS_VERSION and "layer_windows" not in entry:
            raise KeyError("layer_windows")
        if "layer_windows" in entry:        # null passed as "no windows" and broke vmem
            if not isinstance(entry["layer_windows"], list):
                raise TypeError(f"layer_windows must be a list, per layer the window in tokens "
                                f"or null, got {entry['layer_windows']!r}")
            entry["layer_windows"] = tuple(entry["layer_windows"])
        return ModelSpec(**entry)
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"device profile {path}: bad model entry: {error}") from None


def profile_engine(profile: Dict, path: str = "profile") -> Dict:
    """The settings of the engine the profile timed (``engine``; {} in a profile without one):
    ``cache`` (vmem or paged), ``layout``, ``page_bytes`` (vmem), ``max_batch``,
    ``max_context``, ``max_tokens_per_step``; ConfigError naming the file and a bad one, or
    one no calibrate writes (a misspelling)."""
    engine = profile.get("engine", {})
    if not isinstance(engine, dict):
        raise ConfigError(f"device profile {path}: engine must be an object, got {engine!r}")
    unknown = sorted(map(repr, set(engine) - set(ENGINE_KEYS)))
    if unknown:                        # a misspelt setting was dropped: simulate's default ran
        raise ConfigError(f"device profile {path}: engine has unknown {', '.join(unknown)}; its "
                          f"settings are {', '.join(ENGINE_KEYS)}")
    out = {k: v for k, v in engine.items() if v is not None}
    choices = {"cache": ENGINE_CACHES, "layout": LAYOUT_CHOICES}
    for key, value in out.items():
        if key in choices and value not in choices[key]:
            raise ConfigError(f"device profile {path}: engine {key} {value!r} is not one of "
                              f"{', '.join(choices[key])}")
        if key in ENGINE_COUNTS + ("page_bytes",) and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"device profile {path}: engine {key} {value!r} is not an int >= 1")
        if key in ENGINE_COUNT_MAX and value > ENGINE_COUNT_MAX[key]:   # 10**12 hung building
            raise ConfigError(f"device profile {path}: engine {key} {value} is above "
                              f"{ENGINE_COUNT_MAX[key]:,}, more than any engine runs")
    if out.get("max_context", 2) < 2:         # the engine's and calibrate's floor (1 failed
        raise ConfigError(f"device profile {path}: engine max_context {out['max_context']} is "
                          f"below 2, the least any engine runs")        # naming WorkloadSpec)
    if out.get("max_tokens_per_step", math.inf) < out.get("max_batch", 0):   # no engine runs it
        raise ConfigError(f"device profile {path}: engine max_tokens_per_step "
                          f"{out['max_tokens_per_step']} is below its max_batch "
                          f"{out['max_batch']}: a step holds every running sequence")
    return out


def recorded_options(engine_options) -> Dict:
    """``calibrate``'s ``engine_options`` (None: none) as a dict, when the profile's ``engine``
    records each (``ENGINE_KEYS`` less calibrate's own arguments); ConfigError naming the others:
    a kv_cache_dtype "int8" or a block_size 4 was timed, left out of the profile, and simulate
    charged it as the default (a max_batch was a TypeError after loading the model)."""
    options, recorded = dict(engine_options or {}), ("cache", "layout", "page_bytes",
                                                     "max_tokens_per_step")
    other = sorted(set(options) - set(recorded))
    if other:
        raise ConfigError(f"calibrate engine_options {', '.join(other)}: the options a device "
                          f"profile records are {', '.join(recorded)} (max_batch and "
                          f"max_context are calibrate's own arguments); a simulation of a "
                          f"profile timed with another runs its default: leave it out")
    return options


def read_regular(name: str) -> str:
    """The text of the regular file ``name`` (UTF-8). A folder, FIFO or device is refused
    (OSError), not read: opening a FIFO no one writes hung, and simulate reads a profile
    twice (its defaults, then the run), which a pipe cannot give."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError("is a folder: give a file name" if stat.S_ISDIR(mode) else
                          "is not a regular file (a pipe or a device): give a file name")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with open(fd, encoding="utf-8") as f:
        return f.read()


def profile_cost(profile: Dict, map_latency_s: float = 0.0, pages_per_map_op: int = 1) -> ProfileCost:
    """The ProfileCost of a loaded profile."""
    coeffs = {k: float(v) for k, v in fitted_coefficients(profile["coefficients"]).items()}
    return ProfileCost(**coeffs, map_latency_s=map_latency_s, pages_per_map_op=pages_per_map_op)


def fitted_coefficients(coeffs: Dict) -> Dict:
    """The required coefficients and the optional ones (0 where absent: ``load_profile`` lets
    only a profile before version 4 lack them), nothing else."""
    return {**dict.fromkeys(OPTIONAL_COEFFICIENTS, 0.0),
            **{k: coeffs[k] for k in FITTED if k in coeffs}}


def profile_summary(profile: Dict, model_name: str) -> str:
    """What ``vmemkv calibrate`` prints of the profile it wrote: the coefficients in their
    ``UNITS`` with their intervals, the fit's error and the noise check, as text."""
    cal, fit = profile["calibration"], profile["fit"]
    load = cal["load_1min"]
    lines = [f"vmemkv calibrate: {model_name} on {profile['device']}, {len(profile['points'])} "
             f"steps, {min(cal['repeats'])}-{max(cal['repeats'])} repeats of "
             f"{len(cal['repeats'])} shapes (1-minute load {load[0]:.2f} -> {load[1]:.2f})",
             f"  {'coefficient':<22}{'value':>10}     95% interval"]
    for name in FITTED:
        unit, scale = UNITS[name]
        interval = profile["coefficient_intervals"][name]
        lines.append(f"  {name:<22}{profile['coefficients'][name] * scale:>10.4g} {unit:<3} "
                     + (f"[{interval[0] * scale:.4g}, {interval[1] * scale:.4g}] {unit}"
                        if interval else "n/a (fewer than 6 repeats)" if min(cal["repeats"]) < 6
                        or name not in fit.get("undetermined", ())   # absent: written before
                        else "n/a (the timed steps do not determine it)"))
    lines.append(f"  fit error over {fit['design_points']} design points' medians: median "
                 f"{fit['median_rel_error']:.1%}, max {fit['max_rel_error']:.1%}")
    lines.append(f"  noise: {cal['noise']['message']}")
    return "\n".join(lines)
