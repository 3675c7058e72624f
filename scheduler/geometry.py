"""The vmem page geometry, owned in one place: the page layout and everything derived from it.

A vmem *page group* backs one run of ``tokens_per_page`` tokens of one slot across every layer's
K and V. Each member of the group spans ``pages_per_member`` = k consecutive pages, the fewest
whose bytes hold whole tokens (k = 1 whenever a page holds whole tokens; 2 MiB pages and a
token of 1280 bytes give k = 5), so a token may straddle two pages but never two groups:

    per-layer    a page holds one layer's K (or V):  tokens_per_page = k * page_bytes / layer_bytes
                 group = 2 * num_layers * k pages, member j = (layer j // 2, kv j % 2)
    interleaved  a page holds all layers' K (or V):  tokens_per_page = k * page_bytes / (L * layer_bytes)
                 group = 2 * k pages, member j = kv j

where layer_bytes = kv_heads * head_dim * dtype bytes, one layer's K of one token, and
``tokens_per_page`` counts tokens per page group (of one member's k pages). Managers, the
simulator, caches and the engine all read these numbers from a :class:`PageGeometry`.

A hybrid model (full-attention layers beside sliding-window ones) in the per-layer layout can
split each group by layer kind (scheduler.managers.kinds): the members of its ``full_layers``
(2 * L_full * k pages) and those of its ``window_layers`` (2 * L_win * k pages; empty: groups
are not split). The ops name a kind's extent (MapExtent.kind).

Mapping by bytes (k > 1; each kind of a split group alike): the page GROUP stays the unit of
prefix hashing, sharing, copy-on-write, window release and page indices (a group begins at a token boundary
and at a page boundary, so a whole group is exactly "pages wholly inside a common prefix" that
no recomputed token straddles), but a group is BACKED only as far as its bytes need: each
member's first ``member_pages_for(fill)`` = ceil(fill * token_bytes / page_bytes) of its k
pages. A sequence of n tokens on one slot therefore holds ``num_members *
slot_member_pages(n)`` = members x ceil(n * token_bytes / page_bytes) pages (its groups are
whole but the last), not members x k x ceil(n / tokens_per_page). The pool is counted in
*slices* of ``num_members`` pages (one page of every member); a MapExtent with ``first_page``
> 0 grows a group's backing and an UnmapExtent with ``first_page`` > 0 shrinks it
(scheduler.managers.vmem_kinds). With k == 1 a group is one slice and whole backing is the same.
"""
from __future__ import annotations

import math
from functools import cached_property
from dataclasses import dataclass
from enum import Enum

from .errors import ConfigError

KiB, MiB = 2**10, 2**20


class PageLayout(str, Enum):
    """How a vmem page is filled (a ``str``: ``PageLayout.PER_LAYER == "per-layer"``)."""
    PER_LAYER = "per-layer"
    INTERLEAVED = "interleaved"

    def __str__(self) -> str:       # "per-layer" in messages and f-strings, on every Python
        return self.value

    @classmethod
    def parse(cls, value) -> "PageLayout":
        """``value`` (a PageLayout or its name) as a PageLayout, else ConfigError naming it."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {value!r}") from None


LAYOUTS = tuple(layout.value for layout in PageLayout)


AUTO = "auto"
LAYOUT_CHOICES = LAYOUTS + (AUTO,)    # what users may ask for; "auto" never goes downstream
AUTO_PER_LAYER_MAX_TOKENS = 128       # auto: per-layer while its page group holds at most this


def resolve_layout(layout, shape, page_bytes=None, on_cuda: bool = False) -> str:
    """``layout`` as per-layer or interleaved for ``shape`` (anything with ``num_layers``,
    ``layer_bytes_per_token`` and ``layer_windows``: a ModelSpec or a runtime CacheConfig).
    ``"auto"`` picks by one rule: per-layer for a hybrid model (full and sliding-window
    layers: only per-layer gives the windowed layers' pages back), and while a per-layer page
    group holds at most AUTO_PER_LAYER_MAX_TOKENS tokens (of ``page_bytes``; None: each
    layout's default page); else the layout whose page group holds fewer tokens. The figures
    (``benchmarks/layouts.py``; docs/usage.md, "Choosing a layout"): Llama-3-8B,
    Mooncake, 20 GB: per-layer groups of 32 / 128 / 256 / 1,024 tokens held 99.4 / 97.6 / 95.7 /
    89.1% of their memory live and kept the 15.6% prefix hit rate up to 256 tokens, 0.2% at
    1,024; interleaved 99.4-100% at every page size; Gemma-3-27B (hybrid) on 2 MiB pages ran
    777 output tok/s per-layer against 619 interleaved."""
    if layout != AUTO:
        return PageLayout.parse(layout).value
    windows = tuple(shape.layer_windows)
    if None in windows and any(w is not None for w in windows):
        return PageLayout.PER_LAYER.value
    num_layers, layer_bytes = shape.num_layers, shape.layer_bytes_per_token
    group_tokens = {}
    for lay in PageLayout:
        page = page_bytes or default_page_bytes(lay, num_layers, layer_bytes, on_cuda)
        try:
            group_tokens[lay] = PageGeometry(lay, page, num_layers, layer_bytes).tokens_per_page
        except ConfigError:          # a page of this layout holds no whole token
            continue
    per_layer = group_tokens.get(PageLayout.PER_LAYER)
    if per_layer is None and not group_tokens:      # neither holds a token: per-layer's error
        PageGeometry(PageLayout.PER_LAYER, page_bytes, num_layers, layer_bytes)
    if per_layer is not None and (per_layer <= AUTO_PER_LAYER_MAX_TOKENS
                                  or per_layer <= group_tokens.get(PageLayout.INTERLEAVED, per_layer)):
        return PageLayout.PER_LAYER.value
    return PageLayout.INTERLEAVED.value


def _per_token_bytes(layout: PageLayout, num_layers: int, layer_bytes_per_token: int) -> int:
    return layer_bytes_per_token * (1 if layout is PageLayout.PER_LAYER else num_layers)


def default_page_bytes(layout, num_layers: int, layer_bytes_per_token: int, on_cuda: bool) -> int:
    """2 MiB on CUDA (the VMM granularity); on the host the smallest multiple of 64 KiB that
    holds whole tokens of the layout, so small CPU models still get many tokens per page."""
    if on_cuda:
        return 2 * MiB
    per_token = _per_token_bytes(PageLayout.parse(layout), num_layers, layer_bytes_per_token)
    page = 64 * KiB
    while page % per_token:
        page += 64 * KiB
    return page


@dataclass(frozen=True)
class PageGeometry:
    """Page size and layout of one vmem cache; validated on construction (ConfigError). Its
    derived sizes are computed once (``cached_property``: the managers' and caches' hot paths
    read them per page)."""
    layout: PageLayout
    page_bytes: int
    num_layers: int
    layer_bytes_per_token: int     # one layer's K (or V) of one token
    window_layers: tuple = ()      # per-layer hybrid only: the windowed layers

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", PageLayout.parse(self.layout))
        layers = tuple(self.window_layers)
        if layers and (not self.per_layer or len(layers) >= self.num_layers or any(
                not isinstance(i, int) or not 0 <= i < self.num_layers for i in layers)
                or list(layers) != sorted(set(layers))):
            raise ConfigError(f"window_layers must be () or increasing layer indices of a "
                              f"per-layer geometry, fewer than num_layers={self.num_layers}, "
                              f"got {self.window_layers!r}")
        object.__setattr__(self, "window_layers", layers)
        for name in ("page_bytes", "num_layers", "layer_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.page_bytes < self.token_bytes:
            raise ConfigError(f"page_bytes={self.page_bytes} holds no token in the "
                              f"{self.layout.value} layout ({self.token_bytes} bytes per token "
                              f"per page); needs >= {self.token_bytes}")

    @classmethod
    def of(cls, shape, page_bytes: int, layout) -> "PageGeometry":
        """The geometry of ``shape`` (anything with ``num_layers``, ``layer_bytes_per_token``
        and ``layer_windows``: a ModelSpec or a runtime CacheConfig); groups are split by
        layer kind when the layout is per-layer and the model is hybrid."""
        layout = PageLayout.parse(layout)
        windows = tuple(shape.layer_windows)
        hybrid = None in windows and any(w is not None for w in windows)
        split = tuple(i for i, w in enumerate(windows) if w is not None) \
            if hybrid and layout is PageLayout.PER_LAYER else ()
        return cls(layout, page_bytes, shape.num_layers, shape.layer_bytes_per_token, split)

    @cached_property
    def per_layer(self) -> bool:
        return self.layout is PageLayout.PER_LAYER

    @cached_property
    def token_bytes(self) -> int:
        """Bytes one token takes in one page."""
        return _per_token_bytes(self.layout, self.num_layers, self.layer_bytes_per_token)

    @cached_property
    def num_members(self) -> int:
        """Members of a page group: one per (layer, K/V) per-layer, one per K/V interleaved."""
        return 2 * self.num_layers if self.per_layer else 2

    @cached_property
    def pages_per_member(self) -> int:
        """Consecutive pages one member of a page group spans: the fewest whose bytes hold
        whole tokens (1 when a page does)."""
        return self.token_bytes // math.gcd(self.token_bytes, self.page_bytes)

    @cached_property
    def tokens_per_page(self) -> int:
        """Tokens one page group holds (in each member's ``pages_per_member`` pages); a whole
        number for every page size."""
        return self.pages_per_member * self.page_bytes // self.token_bytes

    @cached_property
    def pages_per_group(self) -> int:
        """Physical pages behind one page group (one MapExtent of every kind; at most, where groups are
        backed by their bytes)."""
        return self.num_members * self.pages_per_member

    # -- a split group (hybrid per-layer; see the module docstring) --
    @cached_property
    def split(self) -> bool:
        """Whether groups can be split by layer kind (full layers, windowed layers)."""
        return bool(self.window_layers)

    @cached_property
    def full_layers(self) -> tuple:
        """Layers outside ``window_layers`` (every layer where groups are not split)."""
        windowed = set(self.window_layers)
        return tuple(i for i in range(self.num_layers) if i not in windowed)

    @cached_property
    def group_bytes(self) -> int:
        return self.page_bytes * self.pages_per_group

    @cached_property
    def exact(self) -> bool:
        """Whether one page holds whole tokens only (else members span several pages)."""
        return self.pages_per_member == 1

    def member_pages_for(self, tokens: int) -> int:
        """Pages of each member that hold the first ``tokens`` (<= tokens_per_page) tokens of a
        page group: those covering its bytes [0, tokens * token_bytes), 0..pages_per_member."""
        return -(-tokens * self.token_bytes // self.page_bytes)

    def slot_member_pages(self, tokens: int) -> int:
        """Pages of each member that hold the first ``tokens`` tokens of a slot mapped by bytes:
        k per whole group, then the pages covering the last group's bytes."""
        whole, rest = divmod(tokens, self.tokens_per_page)
        return whole * self.pages_per_member + self.member_pages_for(rest)

    def tokens_in_member_pages(self, pages: int) -> int:
        """Whole tokens that ``pages`` pages of each member hold (the inverse, rounded down)."""
        return pages * self.page_bytes // self.token_bytes

    def round_up_tokens(self, tokens: int) -> int:
        """``tokens`` rounded up to whole pages."""
        return -(-tokens // self.tokens_per_page) * self.tokens_per_page

    def pages_for(self, tokens: int) -> int:
        """Pages (of one slot) that hold ``tokens`` tokens."""
        return -(-tokens // self.tokens_per_page)

    # -- op groups: the independent parts a plan is applied in (one per layer, or one) --
    @property
    def num_op_groups(self) -> int:
        return self.num_layers if self.per_layer else 1

    def members_of(self, op_group: int) -> tuple:
        """Member indices j of a page group that op group ``op_group`` touches."""
        return (2 * op_group, 2 * op_group + 1) if self.per_layer else (0, 1)

    def layers_of(self, op_group: int) -> range:
        return range(op_group, op_group + 1) if self.per_layer else range(self.num_layers)

    def op_group_of_layer(self, layer: int) -> int:
        return layer if self.per_layer else 0
