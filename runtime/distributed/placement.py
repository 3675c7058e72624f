"""Where each rank runs and over which backend its collectives go: pure functions of the model's
device, the size, the user's device list and the number of visible GPUs, so every rule is tested
with fake device counts on a machine without a GPU.

    model on      ranks run on                                 activations    plans, agreement
    cpu           cpu (every rank)                             gloo           gloo
    cuda:k        cuda:k, then the other visible GPUs in       nccl           gloo (CPU tensors:
                  order (cuda:r for rank r when k == 0), or                   bounded waits)
                  ``tp_devices``; under torchrun, rank r runs
                  on cuda:LOCAL_RANK of its own process

Refused before anything starts (TensorParallelConfigError naming the value and the limit):
fewer visible GPUs than ranks, a device list of the wrong length, naming a missing device, a
device twice, mixing device types, or not starting with the model's own device (rank 0 runs the
model where the user put it); ``tp_devices`` with ``tp_launch="env"``; NCCL missing from torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from vmemkv.runtime.engine.errors import TensorParallelConfigError

LOCAL = "cuda"     # a follower's entry under torchrun: cuda:LOCAL_RANK of that process


@dataclass(frozen=True)
class RankPlacement:
    """``devices[r]``: the device rank r runs on ("cpu", "cuda:i", or ``LOCAL`` for a torchrun
    follower that resolves it from LOCAL_RANK)."""
    devices: Tuple[str, ...]

    @property
    def device_type(self) -> str:
        return torch.device(self.devices[0]).type

    @property
    def activation_backend(self) -> str:
        """Backend of the activation all_reduces: the device's own (NCCL on CUDA)."""
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def control_backend(self) -> str:
        """Backend of plans, agreement and fault detection: always gloo on CPU tensors, whose
        waits time out and whose dead peers fail at once."""
        return "gloo"

    def device_of(self, rank: int, local_rank: Optional[int] = None) -> torch.device:
        """Rank ``rank``'s device; ``local_rank`` resolves a torchrun follower's ``LOCAL``."""
        name = self.devices[rank]
        if name == LOCAL:
            return torch.device("cuda", rank if local_rank is None else local_rank)
        return torch.device(name)


def place_ranks(model_device, world: int, tp_devices: Optional[Sequence] = None, *,
                visible_cuda: int, launch: str = "spawn") -> RankPlacement:
    """The placement of ``world`` ranks for a model on ``model_device`` with ``visible_cuda``
    GPUs visible to this process (see the module docstring); TensorParallelConfigError when
    it cannot run."""
    model_device = torch.device(model_device)
    if tp_devices is not None and launch == "env":
        raise TensorParallelConfigError(
            f"tp_devices {list(tp_devices)!r} applies to tp_launch='spawn'; under torchrun rank r "
            f"runs on cuda:LOCAL_RANK (set CUDA_VISIBLE_DEVICES per node instead)")
    if tp_devices is None:
        return _default(model_device, world, visible_cuda, launch)
    devices = _parse(tp_devices, world)
    _check_list(devices, model_device, visible_cuda)
    return RankPlacement(tuple(str(d) for d in devices))


def _default(model_device: torch.device, world: int, visible_cuda: int, launch: str) -> RankPlacement:
    if model_device.type != "cuda":
        return RankPlacement((str(model_device),) * world)
    first = model_device.index or 0
    if launch == "env":
        return RankPlacement((f"cuda:{first}",) + (LOCAL,) * (world - 1))
    if visible_cuda < world:
        raise TensorParallelConfigError(
            f"tensor_parallel_size {world} needs {world} CUDA devices, one per rank, but "
            f"{visible_cuda} are visible (CUDA_VISIBLE_DEVICES decides which)")
    if first >= visible_cuda:
        raise TensorParallelConfigError(f"the model is on cuda:{first} but {visible_cuda} CUDA "
                                        f"devices are visible")
    others = [i for i in range(visible_cuda) if i != first][:world - 1]
    return RankPlacement(tuple(f"cuda:{i}" for i in [first] + others))


def _parse(tp_devices: Sequence, world: int) -> list:
    if isinstance(tp_devices, (str, bytes)) or not hasattr(tp_devices, "__len__"):
        raise TensorParallelConfigError(f"tp_devices must be a list of devices, one per rank "
                                        f"(e.g. ['cuda:0', 'cuda:1']), got {tp_devices!r}")
    if len(tp_devices) != world:
        raise TensorParallelConfigError(f"tp_devices names {len(tp_devices)} device(s) "
                                        f"{list(tp_devices)!r} but tensor_parallel_size is {world}")
    parsed = []
    for entry in tp_devices:
        try:
            is_index = isinstance(entry, int) and not isinstance(entry, bool)
            device = torch.device("cuda", entry) if is_index else torch.device(entry)
        except (RuntimeError, TypeError) as error:
            raise TensorParallelConfigError(f"tp_devices entry {entry!r} is not a device "
                                            f"('cpu', 'cuda:i' or an index): {error}") from None
        parsed.append(device)
    return parsed


def _check_list(devices: list, model_device: torch.device, visible_cuda: int) -> None:
    types = sorted({d.type for d in devices} | {model_device.type})
    if len(types) > 1:
        raise TensorParallelConfigError(
            f"tp_devices {[str(d) for d in devices]!r} mixes device types with the model's "
            f"{model_device} ({', '.join(types)}); every rank must run on the same kind")
    if model_device.type != "cuda":
        return
    visible = f"cuda:0..cuda:{visible_cuda - 1}" if visible_cuda else "none"
    for d in devices:
        if d.index is None or d.index >= visible_cuda:
            raise TensorParallelConfigError(
                f"tp_devices names {d}, but the visible CUDA devices are {visible} "
                f"({visible_cuda} visible; give an index for each)")
    if len({d.index for d in devices}) != len(devices):
        raise TensorParallelConfigError(f"tp_devices {[str(d) for d in devices]!r} names a device "
                                        f"twice; NCCL runs one rank per GPU")
    if devices[0].index != (model_device.index or 0):
        raise TensorParallelConfigError(
            f"tp_devices starts with {devices[0]} but the model is on {model_device}: rank 0 runs "
            f"the model where it is, so list {model_device} first")


def check_backends(placement: RankPlacement, *, nccl_available: bool) -> None:
    """Refuse a CUDA placement when this torch build has no NCCL."""
    if placement.activation_backend == "nccl" and not nccl_available:
        raise TensorParallelConfigError(
            f"tensor parallelism on {placement.devices[0]} needs torch.distributed's NCCL "
            f"backend, which this torch build lacks (torch {torch.__version__})")
