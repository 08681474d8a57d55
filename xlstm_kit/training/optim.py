"""The optimizer (AdamW with weight-decay groups) and the schedule (warmup, then cosine or
linear decay; a resumed run with more steps continues it from where it stood)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from .config import TrainConfig


_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()
)


def _no_decay_owner(module: nn.Module) -> bool:
    # Custom norm layers (head-wise GroupNorm, RMSNorm) are recognised by name as well as type.
    return isinstance(module, (nn.Embedding,) + _NORM_TYPES) or "norm" in type(module).__name__.lower()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on weight matrices only.

    No decay for biases and other vectors/scalars (gate biases, norm scales, learnable skips)
    nor for any parameter owned by an embedding or a normalisation layer — decaying those pulls
    them towards zero, which is not a sensible prior for scales and lookup tables. A parameter
    shared by several modules (a tied embedding/head) is listed once and is not decayed if any
    owner is an embedding.
    """
    owners: dict[int, list[nn.Module]] = {}
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(id(p), []).append(module)
                params[id(p)] = p
    decay, no_decay = [], []
    for pid, p in params.items():
        if p.ndim < 2 or any(_no_decay_owner(m) for m in owners[pid]):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`; fused kernels on CUDA."""
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        fused=True if on_cuda else None,
    )


def _decay_progress(step: int, config: TrainConfig) -> float:
    """Fraction of the cosine decay done at optimizer step ``step`` (>= warmup)."""
    if config.decay_anchor is not None and step >= config.decay_anchor[0]:
        s0, p0 = config.decay_anchor
        return min(1.0, p0 + (1.0 - p0) * (step - s0) / max(1, config.steps - s0))
    return min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup from lr/warmup to lr
    over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps`` (see ``decay_anchor``).

    A pure function of the step, so the schedule's state in a checkpoint is the step count.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = _decay_progress(step, config)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


def continue_schedule(saved: TrainConfig, config: TrainConfig, step: int) -> TrainConfig:
    """``config`` for a run resumed at ``step`` from a checkpoint trained with ``saved``.

    When the total ``steps`` changes, the rest of the cosine decay is stretched (or squeezed)
    from ``step`` to the new total: the learning rate goes on from its value at ``step`` without
    a jump and reaches ``min_lr`` at the new end. (A run that had finished its decay stays at
    ``min_lr``.) Resumed during warmup, the schedule is the one of a fresh run of the new length.
    """
    if config.steps == saved.steps:
        anchor = saved.decay_anchor
    elif step < saved.warmup_steps:
        anchor = None
    else:
        anchor = (step, _decay_progress(step, saved))
    return dataclasses.replace(config, decay_anchor=anchor)
