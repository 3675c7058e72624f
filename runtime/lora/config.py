"""An adapter's ``adapter_config.json`` (PEFT's format): the fields that change the math, and
every field we do not run, refused by name.

Scale of a module of rank r (PEFT's rule): alpha / r, or alpha / sqrt(r) with ``use_rslora``;
``rank_pattern`` / ``alpha_pattern`` give some modules their own r / alpha (the first pattern
key, in file order, that matches the end of the module's name, as PEFT matches them).

Which modules it adapts (PEFT's rule): ``target_modules`` (a regex the whole module name must
match, a list of names or dotted suffixes, or ``all-linear``) less ``exclude_modules``; PEFT
leaves a file's weights of any other module unused, so such a file is refused (``selects``).

The weights are added to the model's own: an ``init_lora_weights`` after which PEFT trains on a
changed copy of them (PiSSA, OLoRA, CorDA, LoRA-GA: W minus the initial B @ A; LoftQ: W
quantized) is refused, pointing to PEFT's conversion to a plain LoRA of W.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, Tuple, Union

from .errors import LoraConfigError

CONFIG_FILE = "adapter_config.json"
ALL_LINEAR = "all-linear"   # PEFT's shorthand target_modules: every linear layer but the head

# field -> what it would need that we do not run; refused when set (not None/False/empty)
_REFUSED_FIELDS = {
    "use_dora": "DoRA (a magnitude vector per module)",
    "modules_to_save": "full trained copies of modules",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "layers_to_transform": "LoRA on some layers only, chosen by index",
    "layer_replication": "layers stacked by replication",
    "lora_bias": "a bias on LoRA B",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on parameters instead of modules",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QALoRA (quantized base)",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA (a singular-value diagonal between A and B)",
    "monteclora_config": "MonteCLoRA (sampled adapters)",
    "arrow_config": "Arrow routing over adapters",
    "velora_config": "VeLoRA (extra per-module projection buffers)",
}

# init_lora_weights values that leave the base weights as they are (PEFT's LoraLayer.update_layer)
_EXACT_INITS = ("gaussian", "eva", "orthogonal", "mica")
_CONVERTED = ("save it as a plain LoRA of the original weights with PEFT's "
              "save_pretrained(..., path_initial_model_for_weight_conversion=...), which writes "
              "init_lora_weights: true")


@dataclass(frozen=True)
class AdapterConfig:
    """The math of an adapter: its default rank and alpha, rsLoRA, and per-module overrides."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Dict[str, int] = field(default_factory=dict)
    alpha_pattern: Dict[str, float] = field(default_factory=dict)
    # PEFT's module selection: a regex the whole name must match, or names each matching the
    # name or a dotted suffix of it; None: not given (PEFT would pick its model-type default)
    target_modules: Union[str, Tuple[str, ...], None] = None
    exclude_modules: Union[str, Tuple[str, ...], None] = None

    def selects(self, module: str) -> bool:
        """Whether PEFT puts a LoRA on ``module`` (its ``check_target_module_exists``):
        targeted and not excluded; ``all-linear`` targets every projection we adapt. A module
        it does not select is one whose weights in the file PEFT leaves unused."""
        if self.exclude_modules and _names_match(self.exclude_modules, module):
            return False
        if isinstance(self.target_modules, str) and self.target_modules.lower() == ALL_LINEAR:
            return True
        return self.target_modules is not None and _names_match(self.target_modules, module)

    def rank_of(self, module: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)

    def alpha_of(self, module: str) -> float:
        return self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)

    def scale_of(self, module: str) -> float:
        r = self.rank_of(module)
        return self.alpha_of(module) / (math.sqrt(r) if self.use_rslora else r)


def _names_match(names: Union[str, Tuple[str, ...]], module: str) -> bool:
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return any(module == name or module.endswith(f".{name}") for name in names)


def _pattern_key(patterns: Dict[str, object], module: str) -> str:
    """PEFT's ``get_pattern_key``: the first key matching a dotted suffix of ``module``."""
    for key in patterns:
        if re.match(_suffix_regex(key), module):
            return key
    return module


def _suffix_regex(key: str) -> str:
    """The regex PEFT matches a pattern key with: ``key`` ending the module's name at a dot."""
    return rf"(.*\.)?({key})$"


def read_config(path: str) -> AdapterConfig:
    """Read and check ``path/adapter_config.json``; raise ``LoraConfigError`` naming the field."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoraConfigError(f"LoRA adapter {path!r}: no {CONFIG_FILE} (not a PEFT adapter "
                              "directory)")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    # RecursionError: JSON nested past Python's stack (it escaped raw: a 500 from the server)
    except (OSError, ValueError, RecursionError) as error:
        raise LoraConfigError(f"LoRA adapter {path!r}: cannot read {CONFIG_FILE}: "
                              f"{error}") from error
    if not isinstance(raw, dict):
        raise LoraConfigError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    return _checked(path, raw)


def _checked(path: str, raw: dict) -> AdapterConfig:
    def refuse(name: str, why: str) -> LoraConfigError:
        return LoraConfigError(f"LoRA adapter {path!r}: {name}={raw.get(name)!r} is not "
                               f"supported ({why})")

    if raw.get("peft_type") != "LORA":
        raise refuse("peft_type", "only LORA adapters are served")
    if raw.get("bias", "none") != "none":
        raise refuse("bias", "bias terms are trained; only bias='none' is served")
    for name, why in _REFUSED_FIELDS.items():
        if _is_set(name, raw.get(name)):
            raise refuse(name, why)
    why = _init_refusal(raw.get("init_lora_weights", True))
    if why:
        raise refuse("init_lora_weights", why)
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if not _is_rank(r):
        raise refuse("r", "a rank is a positive integer")
    if not _is_number(alpha):
        raise refuse("lora_alpha", "alpha is a number")
    ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    if not (isinstance(ranks, dict) and all(_is_rank(v) for v in ranks.values())):
        raise refuse("rank_pattern", "a mapping of module patterns to positive integer ranks")
    if not (isinstance(alphas, dict) and all(_is_number(v) for v in alphas.values())):
        raise refuse("alpha_pattern", "a mapping of module patterns to numbers")
    for name, patterns in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        for key in patterns:
            try:
                re.compile(_suffix_regex(key))
            except re.error as error:
                why = f"key {key!r} is not a regular expression: {error.msg}"
                raise refuse(name, why) from None
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise refuse("use_rslora", "true or false")
    selection = {name: _module_names(raw.get(name), lambda why, n=name: refuse(n, why))
                 for name in ("target_modules", "exclude_modules")}
    return AdapterConfig(r=r, lora_alpha=alpha, use_rslora=use_rslora,
                         rank_pattern=dict(ranks), alpha_pattern=dict(alphas), **selection)


def _is_set(name: str, value) -> bool:
    """Whether PEFT acts on field ``name`` holding ``value``: a truthy value, and for
    ``layers_to_transform`` anything but None and [] (PEFT's rule: an int picks that layer
    alone, so 0 and false pick layer 0; they were taken as unset, [0] refused)."""
    if name == "layers_to_transform":
        return value is not None and value != []
    return value not in (None, False, [], {}, "")


def _module_names(value, refuse) -> Union[str, Tuple[str, ...], None]:
    """target_modules / exclude_modules as PEFT reads them: None, a regex, or a list of names."""
    if value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return None if value is None else tuple(value)
    if not isinstance(value, str):
        raise refuse("a regular expression or a list of module names")
    try:
        re.compile(value)
    except re.error as error:
        raise refuse(f"not a regular expression: {error.msg}") from None
    return value


def _init_refusal(init) -> str:
    """Why an adapter initialised with ``init`` cannot be added to the model's own weights
    (PEFT trained it on a changed copy of them), or "" when it can."""
    if init is None or isinstance(init, bool) or init in _EXACT_INITS:
        return ""
    if not isinstance(init, str):
        return "true, false or the name of one of PEFT's initialisations"
    if init.startswith(("pissa", "corda")) or init.lower() == "olora" or init == "lora_ga":
        return ("the adapter was trained on the base weights minus their initial low-rank part, "
                f"not on the model's own weights; {_CONVERTED}")
    if init == "loftq":
        return ("the adapter was trained on LoftQ's quantized copy of the base weights, not on "
                "the model's own weights; serve that copy as the model, with "
                "init_lora_weights: true in the adapter's config")
    return ("not one of PEFT's initialisations that leave the base weights as they are: true, "
            f"false, {', '.join(map(repr, _EXACT_INITS))}")


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    """A finite int or float, not a bool; an int past a float's range is no finite number
    (lora_alpha written out to 400 digits was an OverflowError from math.isfinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
