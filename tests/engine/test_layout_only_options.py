"""The vmem-only options (a page size, the background mapper, a vmem layout, ...) given to a
paged cache, which has blocks and no pages, were accepted and did nothing: ``Engine`` /
``EngineConfig`` and ``make_kv`` / ``cache_from_layout`` now refuse them by name before anything
is built, as ``vmemkv generate`` / ``serve`` refuse the flags; the same options on vmem, and a
paged cache given their defaults, are taken. ``CacheConfig.device`` other than a str or a
torch.device (``b"cpu"`` was taken) is refused naming ``device``."""
from __future__ import annotations

import pytest
import torch

from vmemkv.cli import main
from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.engine import Engine, EngineConfig, EngineConfigError
from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv import cache_from_layout, make_kv
from vmemkv.vmem.host import HostDriver

from .conftest import model

CONFIG = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_batch=2, max_context=64)
ENGINE_VMEM_ONLY = [dict(page_bytes=4096), dict(background_mapper=True),
                    dict(layout="interleaved")]


@pytest.mark.parametrize("option", ENGINE_VMEM_ONLY, ids=lambda o: next(iter(o)))
def test_an_engine_refuses_a_vmem_only_option_on_the_paged_cache_by_name(option):
    (name, value), = option.items()
    named = rf"^EngineConfig.{name} {value!r} applies to cache='vmem' only; with cache='paged'"
    with pytest.raises(EngineConfigError, match=named):
        EngineConfig(cache="paged", **option)
    with pytest.raises(EngineConfigError, match=named):
        Engine(model(), cache="paged", max_batch=2, max_context=64, self_check=False, **option)


@pytest.mark.parametrize("option", ENGINE_VMEM_ONLY, ids=lambda o: next(iter(o)))
def test_the_vmem_only_options_are_taken_on_vmem_and_their_defaults_on_paged(option):
    (name, value), = option.items()
    assert getattr(EngineConfig(cache="vmem", **option), name) == value
    defaults = EngineConfig(cache="paged", layout="per-layer", page_bytes=None,
                            background_mapper=False)
    assert (defaults.layout, defaults.page_bytes, defaults.background_mapper) == \
        ("per-layer", None, False)


MAKE_KV_VMEM_ONLY = [dict(page_bytes=4096), dict(background_mapper=True),
                     dict(layout="interleaved"), dict(grow_pages=True),
                     dict(hybrid_parts=False), dict(driver="a host driver")]


def _given(option: dict) -> dict:
    return {"driver": HostDriver()} if "driver" in option else option


@pytest.mark.parametrize("option", MAKE_KV_VMEM_ONLY, ids=lambda o: next(iter(o)))
def test_make_kv_refuses_a_vmem_only_option_on_the_paged_cache_by_name(option):
    (name, _), = option.items()
    with pytest.raises(CacheConfigError, match=rf"^make_kv: {name} .* applies to kind='vmem' "
                                               rf"only; with kind='paged' it would do nothing"):
        make_kv(CONFIG, "paged", **_given(option))
    with make_kv(CONFIG, "vmem", **_given(option)) as kv:      # where it applies: taken
        assert kv.cache.kind.value == "vmem"


def test_make_kv_builds_a_paged_cache_given_the_vmem_options_at_their_defaults():
    with make_kv(CONFIG, "paged", block_size=8, layout="per-layer", page_bytes=None,
                 background_mapper=False, driver=None, grow_pages=False,
                 hybrid_parts=True) as kv:
        assert (kv.cache.kind.value, kv.cache.block_size) == ("paged", 8)


@pytest.mark.parametrize("flag", ["background_mapper", "grow_pages"])
def test_cache_from_layout_refuses_a_vmem_flag_for_a_paged_layout(flag):
    with make_kv(CONFIG, "paged") as kv:
        layout = kv.manager.layout()
        with pytest.raises(CacheConfigError, match=rf"^cache_from_layout: {flag} True applies "
                                                   rf"to kind='vmem' only"):
            cache_from_layout(layout, CONFIG, **{flag: True})
        assert cache_from_layout(layout, CONFIG).kind.value == "paged"


@pytest.mark.parametrize("device", [b"cpu", 0, ["cpu"]])
def test_a_cache_device_that_is_no_str_or_torch_device_is_refused_naming_device(device):
    with pytest.raises(CacheConfigError, match=rf"^CacheConfig.device must be 'cpu' or "
                                               rf"'cuda\[:i\]', got .* of type "
                                               rf"{type(device).__name__} \(a str or "
                                               rf"torch.device is taken\)"):
        CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, device=device)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_a_str_or_torch_device_is_taken(device):
    config = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, device=device)
    assert config.torch_device == torch.device("cpu")


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("flag", [["--page-bytes", "64KiB"], ["--background-mapper"]])
def test_the_cli_refuses_a_vmem_flag_with_the_paged_cache_in_one_line_exit_2(command, flag,
                                                                              capsys):
    assert main([command, "--cache", "paged", *flag]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"vmemkv {command}: error: GenerateUsageError: {flag[0]} applies "
                              f"to --cache vmem only; with --cache paged it would do nothing: "
                              f"drop it\n")
