"""``layout="auto"``: one rule (scheduler.geometry.resolve_layout) resolved before anything is
built, by the simulator, the engine and VMemCache alike; nothing downstream sees "auto"."""
from __future__ import annotations

import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.geometry import AUTO_PER_LAYER_MAX_TOKENS, PageGeometry, resolve_layout
from vmemkv.scheduler.presets import MODELS
from vmemkv.scheduler.simulator import SimConfig, simulate
from vmemkv.scheduler.workload import WorkloadSpec, generate

KiB, MiB = 2**10, 2**20


def pick(model: str, page_bytes: int) -> str:
    return resolve_layout("auto", MODELS[model], page_bytes, on_cuda=True)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_on_2mib_pages_hybrids_get_per_layer_and_the_others_the_smaller_groups(model):
    m = MODELS[model]
    groups = {lay: PageGeometry.of(m, 2 * MiB, lay).tokens_per_page
              for lay in ("per-layer", "interleaved")}
    want = "per-layer" if m.is_hybrid or groups["per-layer"] <= AUTO_PER_LAYER_MAX_TOKENS else \
        min(groups, key=lambda lay: (groups[lay], lay != "per-layer"))
    assert pick(model, 2 * MiB) == want
    # every preset's per-layer group holds >= 512 tokens: interleaved unless hybrid
    assert pick(model, 2 * MiB) == ("per-layer" if model == "gemma-3-27b" else "interleaved")


@pytest.mark.parametrize("page_bytes, layout", [(64 * KiB, "per-layer"),    # 32-token groups
                                                (256 * KiB, "per-layer"),   # 128: the bound
                                                (512 * KiB, "interleaved"),  # 256
                                                (2 * MiB, "interleaved")])  # 1,024
def test_llama_3_8b_switches_to_interleaved_past_128_token_groups(page_bytes, layout):
    assert pick("llama-3-8b", page_bytes) == layout


def test_per_layer_when_an_interleaved_page_holds_no_whole_token():
    # 40 layers of 10,240 bytes: 409,600 bytes a token interleaved, over a 64 KiB page
    assert pick("opt-13b", 64 * KiB) == "per-layer"


def test_explicit_layouts_pass_through_and_unknown_ones_are_refused_by_name():
    llama = MODELS["llama-3-8b"]
    assert resolve_layout("interleaved", llama, 64 * KiB) == "interleaved"
    assert resolve_layout("per-layer", llama, 2 * MiB) == "per-layer"
    with pytest.raises(ConfigError, match="'diagonal'"):
        resolve_layout("diagonal", llama, 2 * MiB)
    with pytest.raises(ConfigError, match="'diagonal'"):
        SimConfig(policy="vmem", layout="diagonal")


def test_the_simulator_runs_auto_as_the_layout_it_resolves_to():
    entries = generate(WorkloadSpec(num_requests=60, seed=5))
    auto = SimConfig(policy="vmem", layout="auto", cache_bytes=4 * 10**9)
    assert auto.resolved_layout == "interleaved"
    assert auto.make_manager().layout().geometry.layout.value == "interleaved"
    got = simulate(entries, auto)
    same = simulate(entries, SimConfig(policy="vmem", layout="interleaved", cache_bytes=4 * 10**9))
    assert (got.output_tokens, got.num_steps, got.kv_utilization) == \
        (same.output_tokens, same.num_steps, same.kv_utilization)
