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


def builds_on_meta(dist: DistInfo, parallel: str, sharded_resume: bool = False) -> bool:
    """Whether this process should build its model on the meta device: a rank of an FSDP run of
    several processes whose weights come as its shards from elsewhere: from rank 0 (every rank
    but 0), or, when ``sharded_resume`` (a resume from a sharded checkpoint), from the checkpoint
    (every rank, 0 included: see ``shard_model``'s ``weights_from``)."""
    return parallel == "fsdp" and dist.enabled and (sharded_resume or not dist.is_main)


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for prefix, module in model.named_modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            buf = module._buffers.get(name)
            if buf is not None:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


WEIGHTS_FROM = ("rank0", "checkpoint")


def shard_model(model: nn.Module, dist: DistInfo, device: torch.device, precision: str,
                weights_from: str = "rank0") -> None:
    """Shard ``model`` in place with FSDP2 over a 1-D DeviceMesh of all ranks: each block is one
    unit (its weights are gathered just before its forward and backward and freed after, so one
    block's full weights are in memory at a time), the root takes what is left (embedding, final
    norm, head). Under bf16 training on CUDA the gathered weights are bf16 while the shards, the
    optimizer state and the gradient reduction stay float32. Activation checkpointing and
    compiled blocks must be applied before, as they wrap the blocks this shards.

    ``weights_from="rank0"``: every rank ends with its shard of rank 0's weights. Rank 0 must
    hold them in full; the other ranks may have built ``model`` on the meta device
    (``builds_on_meta``), and then allocate only their shards: no rank but 0 ever holds the
    whole model.

    ``weights_from="checkpoint"``: the caller fills the shards next from a sharded checkpoint
    (``xlstm_kit.io.sharded.load_sharded_into``), so nothing is broadcast and any rank, 0
    included, may be on meta: it allocates its shards uninitialised. Non-persistent buffers are
    in no checkpoint: they are taken from rank 0 when it built its model with them, and a meta
    rank 0 with such buffers is refused (their values would be garbage)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if weights_from not in WEIGHTS_FROM:
        raise XLSTMKitError(f"shard_model's weights_from must be one of {WEIGHTS_FROM}, got {weights_from!r}")
    if not torch_dist.is_initialized():
        raise XLSTMKitError("parallel='fsdp' needs a process group: run under torchrun and pass "
                            "dist=init_distributed(parallel='fsdp')")
    meta = on_meta(model)
    if dist.enabled:
        # collective, so that every rank refuses together instead of the others waiting forever
        flags = [None] * dist.world_size
        torch_dist.all_gather_object(flags, (meta, weights_from))
        rank0_meta = bool(flags[0][0])
        if len({w for _, w in flags}) > 1:
            # some ranks would wait in the broadcast of rank 0's weights that the others skip
            raise XLSTMKitError(f"the ranks disagree on where the weights come from: "
                                f"{', '.join(w for _, w in flags)} (ranks 0..{dist.world_size - 1})")
    else:
        rank0_meta = meta
    from_checkpoint = weights_from == "checkpoint"
    if from_checkpoint and rank0_meta and _non_persistent_buffers(model):
        # the same model on every rank: every rank refuses together
        raise XLSTMKitError("the model has non-persistent buffers, which no checkpoint holds: build rank 0's "
                            "model with its weights (not on the meta device) to resume it under FSDP")
    if rank0_meta and not from_checkpoint:
        raise XLSTMKitError("FSDP sharding needs rank 0's model built with its weights; rank 0's is on the "
                            "meta device (only the other ranks may build theirs there)")
    full = None
    if dist.enabled and dist.is_main and not from_checkpoint:
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
    if meta:
        model.to_empty(device=device)  # this rank's shards only: the parameters are sharded DTensors now
    if not dist.enabled:
        return
    if not from_checkpoint:
        # every rank starts from rank 0's weights, as DistributedDataParallel's constructor ensures;
        # one tensor at a time, so no rank but 0 holds more than one full tensor
        set_model_state_dict(model, full if dist.is_main else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    # non-persistent buffers are in no state dict: rank 0's values, also over to_empty's garbage
    with torch.no_grad():
        for _, buf in _non_persistent_buffers(model):
            torch_dist.broadcast(buf, 0)
