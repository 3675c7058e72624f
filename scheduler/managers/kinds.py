"""Layer kinds: the classes of a model's layers that share one attention pattern, and so one
table of memory (the full-attention layers, the layers of one sliding window, ...).

    kinds_of(gemma3)  ->  (KindSpec("full", layers=(5, 11, ...), window_tokens=None),
                           KindSpec("window-1024", layers=(0, 1, 2, 3, 4, 6, ...), 1024))

A kind differs from another only in which tokens its layers still read: a full kind reads all
of them, a windowed kind only the last ``window_tokens`` before each query, so it may give back
what lies wholly behind its window. Managers keep one table per kind over one page ledger
(ledger.py); a model whose layers are all full, or all of one window, has one kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..presets import ModelSpec


@dataclass(frozen=True)
class KindSpec:
    """One layer kind: its ``name``, the model ``layers`` it covers (ascending), and the
    sliding window its layers attend within (tokens; None: full attention)."""
    name: str
    layers: tuple
    window_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        layers = self.layers
        if (not isinstance(layers, tuple) or not layers or list(layers) != sorted(set(layers))
                or any(isinstance(l, bool) or not isinstance(l, int) or l < 0 for l in layers)):
            raise ConfigError(f"KindSpec {self.name!r} layers must be a non-empty ascending "
                              f"tuple of distinct layer indexes, got {layers!r}")
        w = self.window_tokens
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(f"KindSpec {self.name!r} window_tokens must be None or an int "
                              f">= 1, got {w!r}")

    @property
    def windowed(self) -> bool:
        return self.window_tokens is not None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def kinds_of(model: ModelSpec) -> tuple:
    """The model's layer kinds: full layers first (named "full"), then one kind per distinct
    window, narrowest first (named "window-W"). Every layer is in exactly one."""
    windows = model.layer_windows or (None,) * model.num_layers
    full = tuple(i for i, w in enumerate(windows) if w is None)
    kinds = [KindSpec("full", full)] if full else []
    for w in sorted({w for w in windows if w is not None}):
        kinds.append(KindSpec(f"window-{w}", tuple(i for i, x in enumerate(windows) if x == w), w))
    return tuple(kinds)
