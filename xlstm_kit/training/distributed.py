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


def on_meta(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters or buffers is on the meta device (shapes only)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def builds_on_meta(dist: DistInfo, parallel: str) -> bool:
    """Whether this process should build its model on the meta device: a rank other than 0 of
    an FSDP run of several processes, whose weights come from rank 0 as its shards."""
    return parallel == "fsdp" and dist.enabled and not dist.is_main


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for prefix, module in model.named_modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            buf = module._buffers.get(name)
            if buf is not None:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def shard_model(model: nn.Module, dist: DistInfo, device: torch.device, precision: str) -> None:
    """Shard ``model`` in place with FSDP2 over a 1-D DeviceMesh of all ranks: each block is one
    unit (its weights are gathered just before its forward and backward and freed after, so one
    block's full weights are in memory at a time), the root takes what is left (embedding, final
    norm, head). Under bf16 training on CUDA the gathered weights are bf16 while the shards, the
    optimizer state and the gradient reduction stay float32. Activation checkpointing and
    compiled blocks must be applied before, as they wrap the blocks this shards.

    Every rank ends with its shard of rank 0's weights. Rank 0 must hold them in full; the
    other ranks may have built ``model`` on the meta device (``builds_on_meta``), and then
    allocate only their shards: no rank but 0 ever holds the whole model."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch_dist.is_initialized():
        raise XLSTMKitError("parallel='fsdp' needs a process group: run under torchrun and pass "
                            "dist=init_distributed(parallel='fsdp')")
    meta = on_meta(model)
    if dist.enabled:
        # collective, so that every rank refuses together instead of the others waiting forever
        flags = [None] * dist.world_size
        torch_dist.all_gather_object(flags, meta)
        rank0_meta = bool(flags[0])
    else:
        rank0_meta = meta
    if rank0_meta:
        raise XLSTMKitError("FSDP sharding needs rank 0's model built with its weights; rank 0's is on the "
                            "meta device (only the other ranks may build theirs there)")
    full = None
    if dist.enabled and dist.is_main:
        # references to rank 0's own tensors, no copy; taken before fully_shard replaces them
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mesh = init_device_mesh(device.type, (dist.world_size,))
    if device.type == "cuda" and precision in ("auto", "bf16"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if not dist.enabled:
        return
    if meta:
        model.to_empty(device=device)  # this rank's shards only: the parameters are sharded DTensors now
    # every rank starts from rank 0's weights, as DistributedDataParallel's constructor ensures;
    # one tensor at a time, so no rank but 0 holds more than one full tensor
    set_model_state_dict(model, full if dist.is_main else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    # non-persistent buffers are in no state dict: rank 0's values, also over to_empty's garbage
    with torch.no_grad():
        for _, buf in _non_persistent_buffers(model):
            torch_dist.broadcast(buf, 0)
