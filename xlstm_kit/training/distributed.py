"""Distributed set-up: where this process sits in a `torchrun` run (one process: rank 0 of 1)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


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


def init_distributed(device_type: str | None = None) -> DistInfo:
    """Join the process group that ``torchrun`` describes through its environment variables.

    Without ``WORLD_SIZE`` > 1 this is a single-process run and nothing is initialised. The
    backend is NCCL on CUDA and gloo on CPU; on CUDA each process takes GPU ``LOCAL_RANK``.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
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
