"""The roofline cost model on hand-computed examples."""
import pytest

from vmemkv.scheduler.cost import CostModel, count_map_ops
from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.managers.base import CopyBlock, MapExtent
from vmemkv.scheduler.presets import get_device, get_model

LLAMA, H100 = get_model("llama-3-8b"), get_device("h100")


def test_decode_step_is_weights_plus_kv_over_bandwidth():
    # 16.06 GB weights + 10,000 tokens * 131,072 B = 17.37072 GB at 3.35 TB/s = 5.1853 ms
    t = CostModel(LLAMA, H100).step_seconds(context_tokens=10_000, new_tokens=100)
    assert t == pytest.approx((16.06e9 + 10_000 * 131_072) / 3.35e12)
    assert t == pytest.approx(5.18529e-3, rel=1e-5)


def test_prefill_costs_only_bandwidth_by_default():
    model = CostModel(LLAMA, H100)
    assert model.step_seconds(4096, 4096) == model.step_seconds(4096, 1)


def test_prefill_is_compute_bound_at_the_given_mfu():
    # 2 * 8.03e9 params * 8192 tokens / (0.5 * 989e12 FLOP/s) = 266.0 ms > 5.1 ms of reads
    t = CostModel(LLAMA, H100, prefill_mfu=0.5).step_seconds(8192, 8192)
    assert t == pytest.approx(2 * 8.03e9 * 8192 / (0.5 * 989e12))
    assert t == pytest.approx(0.26603, rel=1e-4)


def test_map_latency_and_paged_slowdown():
    base = CostModel(LLAMA, H100)
    mapped = CostModel(LLAMA, H100, map_latency_s=2e-6, pages_per_map_op=64)
    assert mapped.step_seconds(1000, 1, mapped_pages=3 * 64) == pytest.approx(
        base.step_seconds(1000, 1) + 3 * 64 * 2e-6)
    slow = CostModel(LLAMA, H100, kv_slowdown=1.5)
    assert slow.step_seconds(1000, 1) == pytest.approx((16.06e9 + 1.5 * 1000 * 131_072) / 3.35e12)


def test_count_map_ops_counts_page_groups_mapped():
    ops = [MapExtent(0, 0, "full", (0, 1)), CopyBlock(1, 2), MapExtent(0, 1, "full", (2, 3))]
    assert count_map_ops(ops) == 2 and count_map_ops([]) == 0
    # a hybrid group's two kinds at one place count once; growing an extent is no new group
    both = [MapExtent(0, 0, "full", (0, 1)), MapExtent(0, 0, "window-8", (2, 3)),
            MapExtent(0, 0, "full", (4, 5), first_page=1)]
    assert count_map_ops(both) == 1


def test_a_place_mapped_again_after_another_op_counts_as_a_second_map():
    """Only consecutive ops at one (slot, page_index) are one group's mapping: the same place
    mapped again after another op (its extent unmapped, then mapped afresh) costs a second map."""
    again = [MapExtent(0, 0, "full", (0, 1)), CopyBlock(1, 2), MapExtent(0, 0, "full", (2, 3))]
    assert count_map_ops(again) == 2


@pytest.mark.parametrize("kwargs,field", [
    (dict(prefill_mfu=0.0), "prefill_mfu"), (dict(prefill_mfu=1.5), "prefill_mfu"),
    (dict(map_latency_s=-1.0), "map_latency_s"), (dict(pages_per_map_op=0), "pages_per_map_op"),
    (dict(kv_slowdown=0.5), "kv_slowdown"),
])
def test_bad_cost_parameters_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CostModel(LLAMA, H100, **kwargs)
