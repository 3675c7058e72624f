"""What ``--page-bytes`` (and ``EngineConfig.page_bytes``) default to, as the help and
docs/usage.md state it: 2 MiB on CUDA; on the host the smallest multiple of 64 KiB holding
whole tokens of the layout. The help said "the driver's choice" (the host driver's granularity
is 4 KiB) and the doc "~64 KiB on the host" (``smollm2-geometry``'s page is 192 KiB)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vmemkv.cli import build_parser
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.engine import Engine
from vmemkv.runtime.hf.support import kv_shape_of
from vmemkv.runtime.kv import default_page_bytes
from vmemkv.runtime.models import build_model, model_config

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
KiB = 1024


def _page_help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if "--page-bytes" in a.option_strings)
    return " ".join(action.help.split())


def _host_page(name: str, layout: str = "per-layer") -> int:
    config = CacheConfig(**kv_shape_of(model_config(name)), dtype=torch.float32, device="cpu",
                         max_batch=1, max_context=64)
    return default_page_bytes(config, layout)


def test_the_help_and_the_doc_state_the_default_pages_rule():
    for command in ("generate", "serve"):
        assert ("(default: 2MiB on CUDA, its VMM granularity; on the host the smallest multiple "
                "of 64KiB holding whole tokens of the layout)") in _page_help(command)
    doc = " ".join(USAGE.read_text().split())
    assert ("default 2 MiB on CUDA, its VMM granularity; on the host the smallest multiple of "
            "64 KiB that holds whole tokens of the layout: 64 KiB for `tiny-llama`, 192 KiB for "
            "`smollm2-geometry` per-layer") in doc


def test_the_docs_example_pages_are_the_engines():
    # smollm2-geometry: 768 bytes a layer's token, so 64 and 128 KiB hold no whole token
    assert (_host_page("tiny-llama"), _host_page("smollm2-geometry")) == (64 * KiB, 192 * KiB)
    with Engine(build_model("tiny-llama"), cache="vmem", max_batch=2, max_context=64,
                self_check=False) as engine:
        assert engine.kv.manager.page_bytes == _host_page("tiny-llama")
