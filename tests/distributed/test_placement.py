"""Where ranks run and what is refused, with fake GPU counts (no GPU needed): the pure placement
rules and the CUDA start-up path failing cleanly on this machine (memory: test_tp_memory.py)."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from vmemkv.runtime.distributed import TensorParallelConfigError, TensorParallelError
from vmemkv.runtime.distributed.placement import RankPlacement, check_backends, place_ranks
from vmemkv.runtime.engine import Engine

from ..engine.conftest import model


def test_cpu_ranks_all_run_on_the_cpu_over_gloo():
    p = place_ranks("cpu", 2, visible_cuda=0)
    assert p.devices == ("cpu", "cpu")
    assert (p.activation_backend, p.control_backend) == ("gloo", "gloo")


def test_cuda_rank_r_runs_on_cuda_r_with_nccl_activations_and_gloo_control():
    p = place_ranks("cuda:0", 4, visible_cuda=8)
    assert p.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert [p.device_of(r) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert (p.activation_backend, p.control_backend) == ("nccl", "gloo")


def test_a_model_on_another_gpu_keeps_rank_0_there_and_takes_the_others_in_order():
    assert place_ranks("cuda:2", 3, visible_cuda=4).devices == ("cuda:2", "cuda:0", "cuda:1")


def test_a_device_list_sets_each_ranks_device():
    p = place_ranks("cuda:1", 2, ["cuda:1", 3], visible_cuda=4)
    assert p.devices == ("cuda:1", "cuda:3")


def test_torchrun_followers_resolve_their_device_from_local_rank():
    p = place_ranks("cuda:0", 2, visible_cuda=1, launch="env")
    assert p.device_of(0) == torch.device("cuda", 0)
    assert p.device_of(1, local_rank=5) == torch.device("cuda", 5)


@pytest.mark.parametrize("device, world, devices, visible, launch, match", [
    ("cuda:0", 2, None, 1, "spawn", "tensor_parallel_size 2 needs 2 CUDA devices, one per rank, "
                                    "but 1 are visible"),
    ("cuda:0", 2, None, 0, "spawn", "needs 2 CUDA devices, one per rank, but 0 are visible"),
    ("cuda:0", 2, ["cuda:0"], 4, "spawn", r"tp_devices names 1 device\(s\) \['cuda:0'\] but "
                                          "tensor_parallel_size is 2"),
    ("cuda:0", 2, ["cuda:0", "cuda:2"], 2, "spawn", "tp_devices names cuda:2, but the visible "
                                                    "CUDA devices are cuda:0..cuda:1"),
    ("cuda:0", 2, ["cuda:0", "cuda"], 2, "spawn", "tp_devices names cuda, but"),
    ("cuda:0", 2, ["cuda:0", "cpu"], 2, "spawn", "mixes device types with the model's cuda:0"),
    ("cpu", 2, ["cpu", "cuda:0"], 2, "spawn", "mixes device types with the model's cpu"),
    ("cuda:0", 2, ["cuda:0", "cuda:0"], 2, "spawn", "names a device twice"),
    ("cuda:0", 2, ["cuda:1", "cuda:0"], 2, "spawn", "starts with cuda:1 but the model is on cuda:0"),
    ("cuda:0", 2, ["cuda:0", "gpu:1"], 2, "spawn", "tp_devices entry 'gpu:1' is not a device"),
    ("cuda:0", 2, "cuda:0,cuda:1", 2, "spawn", "tp_devices must be a list of devices"),
    ("cuda:0", 2, ["cuda:0", "cuda:1"], 2, "env", "applies to tp_launch='spawn'"),
])
def test_device_counts_and_lists_that_cannot_run_are_refused_naming_the_value(
        device, world, devices, visible, launch, match):
    with pytest.raises(TensorParallelConfigError, match=match):
        place_ranks(device, world, devices, visible_cuda=visible, launch=launch)


def test_cuda_without_nccl_is_refused_and_cpu_needs_none():
    check_backends(RankPlacement(("cpu", "cpu")), nccl_available=False)
    with pytest.raises(TensorParallelConfigError, match="needs torch.distributed's NCCL backend"):
        check_backends(RankPlacement(("cuda:0", "cuda:1")), nccl_available=False)


def test_a_cpu_model_with_a_cuda_device_list_is_refused_before_any_process_starts():
    before = multiprocessing.active_children()
    with pytest.raises(TensorParallelConfigError, match="mixes device types"):
        Engine(model(), max_batch=2, max_context=64, tensor_parallel_size=2,
               tp_devices=["cuda:0", "cuda:1"])
    assert multiprocessing.active_children() == before


def test_cuda_rank_start_up_on_a_machine_without_cuda_fails_cleanly_with_no_process_left():
    # past the engine's checks (as if two GPUs were visible): each spawned rank makes its GPU
    # current first, which fails here; rank 0 must raise within the start timeout, no orphan
    from vmemkv.runtime.distributed.launch import TensorParallel
    from vmemkv.runtime.distributed.worker import TPPayload
    from vmemkv.runtime.config import CacheConfig
    payload = TPPayload(cache_config=CacheConfig(num_layers=2, num_kv_heads=1, head_dim=16,
                                                 max_batch=1, max_context=64),
                        kind="paged", kv_options={}, attention="cpu-varlen", step_timeout_s=5.0,
                        start_timeout_s=60.0, placement=RankPlacement(("cuda:0", "cuda:1")))
    with pytest.raises(TensorParallelError, match="rank 1 failed: .*(CUDA|cuda)"):
        TensorParallel(model(), payload, 2)
    assert not multiprocessing.active_children()


def test_cuda_activations_go_over_an_nccl_group_that_blocks_and_times_out_at_the_step_timeout(
        monkeypatch):
    import datetime
    import os
    from types import SimpleNamespace
    from vmemkv.runtime.distributed import group as g
    made, reduced = [], []
    monkeypatch.setattr(g.dist, "new_group", lambda **kw: made.append(kw) or "nccl-group")
    monkeypatch.setattr(g.dist, "all_reduce", lambda t, group=None, async_op=False, op=None: reduced.append(
        group) or SimpleNamespace(wait=lambda timeout=None: True))
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    rank = g.RankGroup(1, 2, step_timeout_s=7.0)
    g.open_activation_group(rank, "gloo", torch.device("cpu"))
    assert rank.activation_group is None and made == []      # gloo: the default group
    g.open_activation_group(rank, "nccl", torch.device("cuda", 1))
    assert made == [dict(backend="nccl", timeout=datetime.timedelta(seconds=7.0),
                         device_id=torch.device("cuda", 1))]
    assert (os.environ["TORCH_NCCL_BLOCKING_WAIT"], os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) \
        == ("1", "2")
    rank.all_reduce_(torch.zeros(2))
    rank.min_over_ranks(1, "agreement")
    assert reduced == ["nccl-group", None]    # activations over NCCL, agreement over gloo
