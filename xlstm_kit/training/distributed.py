"""Distributed set-up: where this process sits in a `torchrun` run (one process: rank 0 of 1)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch import nn

from ..errors import XLSTMKitError


@dataclass
class DistInfo:
    """Where this process sits in a (possibly single-process) run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str | None = None, parallel: str = "ddp") -> DistInfo:
    """Join the process group that ``torchrun`` describes through its environment variables.

    Without ``WORLD_SIZE`` > 1 this is a single-process run and nothing is initialised, except
    for ``parallel="fsdp"``: FSDP2 shards over a process group, also of one process, so it needs
    torchrun's variables (XLSTMKitError in one line without them). The backend is NCCL on CUDA
    and gloo on CPU; on CUDA each process takes GPU ``LOCAL_RANK``.
    """
    if parallel == "fsdp" and not ("WORLD_SIZE" in os.environ and "RANK" in os.environ):
        raise XLSTMKitError("--parallel fsdp needs torchrun (no WORLD_SIZE/RANK in the environment): "
                            "torchrun --nproc-per-node N -m xlstm_kit train ... --parallel fsdp")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and parallel != "fsdp":
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(local)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local)


def default_device(dist: DistInfo) -> torch.device:
    return torch.device(f"cuda:{dist.local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def shard_model(model: nn.Module, dist: DistInfo, device: torch.device, precision: str) -> None:
    """Shard ``model`` in place with FSDP2 over a 1-D DeviceMesh of all ranks: each block is one
    unit (its weights are gathered just before its forward and backward and freed after, so one
    block's full weights are in memory at a time), the root takes what is left (embedding, final
    norm, head). Under bf16 training on CUDA the gathered weights are bf16 while the shards, the
    optimizer state and the gradient reduction stay float32. Activation checkpointing and
    compiled blocks must be applied before, as they wrap the blocks this shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch_dist.is_initialized():
        raise XLSTMKitError("parallel='fsdp' needs a process group: run under torchrun and pass "
                            "dist=init_distributed(parallel='fsdp')")
    # every rank starts from rank 0's weights, as DistributedDataParallel's constructor ensures
    with torch.no_grad():
        for t in model.state_dict().values():
            torch_dist.broadcast(t, 0)
    mesh = init_device_mesh(device.type, (dist.world_size,))
    if device.type == "cuda" and precision in ("auto", "bf16"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
