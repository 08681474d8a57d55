"""One optimizer step (forward under autocast, loss, backward with gradient accumulation, clipping,
learning rate, update) and the wall-clock step budget: the pieces every loop of the library runs
(`train`, the synthetic experiments, the training benchmark)."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import XLSTMKitError
from .packing import model_forward


def autocast(device: torch.device | str, precision: str):
    """The one mixed-precision rule: "bf16" autocasts to bfloat16 on any device, "auto" on CUDA
    only, "fp32" never (weights stay float32 either way)."""
    device = torch.device(device)
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of logits [B, T, V] against targets [B, T], computed in float32."""
    if logits.ndim != 3 or logits.shape[:2] != targets.shape:
        raise XLSTMKitError(
            f"logits must be [B, T, V] matching targets [B, T], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


@dataclass
class StepOutput:
    """Tensors on the device, so that a loop that does not read them every step never waits for
    the GPU (float() them to read)."""

    loss: torch.Tensor  # mean loss of the step over its micro-batches (detached)
    grad_norm: torch.Tensor  # global gradient norm before clipping


class NonFiniteStep(XLSTMKitError):
    """A step's loss or gradient norm was NaN or infinite; `train_step(check_finite=True)` raised
    it before the update."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"non-finite step: loss {loss}, gradient norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    *,
    lr: float,
    n_micro: int = 1,
    precision: str = "auto",
    grad_clip: float = 0.0,
    before_update: Callable[[], None] | None = None,
    check_finite: bool = False,
) -> StepOutput:
    """One optimizer step: for each (inputs, target) of ``micro_batches`` (``n_micro`` of them),
    ``loss_fn(model(inputs), target) / n_micro`` under :func:`autocast` and its backward; then
    clipping of the global gradient norm to ``grad_clip`` (0: no clipping), the learning rate
    ``lr`` set on every parameter group, the update, and the gradients cleared.

    ``model`` may be DistributedDataParallel: only the last micro-batch's backward all-reduces
    the accumulated gradients. ``before_update`` runs just before ``optimizer.step()`` (the
    training loop marks there that an interrupt can no longer be saved consistently).
    ``check_finite``: a NaN or infinite loss or gradient norm raises :class:`NonFiniteStep`
    before the update (the weights stay those of the last step; one host sync per step).
    """
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    n_done = 0
    for micro, (inputs, target) in enumerate(micro_batches):
        last = micro == n_micro - 1
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter once, after the last micro-batch
            model.set_requires_gradient_sync(last)
        with (model.no_sync() if hasattr(model, "no_sync") and not last else contextlib.nullcontext()):
            with autocast(device, precision):
                logits = model_forward(model, inputs)
            loss = loss_fn(logits, target) / n_micro
            loss.backward()
        loss_sum += loss.detach()
        n_done += 1
    if n_done != n_micro:
        raise XLSTMKitError(f"train_step got {n_done} micro-batches, expected n_micro={n_micro}")
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(grad_norm, "full_tensor"):  # sharded (FSDP2) gradients: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    if check_finite:
        loss_v, norm_v = (float(x) for x in torch.stack([loss_sum.float(), grad_norm.float()]).cpu())
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(loss_v, norm_v)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if before_update is not None:
        before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(loss_sum, grad_norm.detach())


class TimeBudget:
    """A wall-clock budget for a loop of steps: is it spent, how long does a step take, how many
    steps fit in what is left. Used by ``train(time_limit_s=...)``, the demo and the experiments.

    Steps up to ``skip_steps`` are not timed (they carry one-time costs: kernel compilation,
    allocator growth); the time per step is the mean over the steps after them. On CUDA, pass
    ``device`` so the timing points wait for queued kernels. ``seconds=None``: never spent.
    """

    def __init__(self, seconds: float | None, *, skip_steps: int = 2, device: torch.device | str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = seconds
        self.skip_steps = skip_steps
        self._clock = clock
        self._cuda = device is not None and torch.device(device).type == "cuda"
        self._start = clock()
        self._mark: tuple[int, float] | None = None
        self._last: tuple[int, float] | None = None

    def _now(self, sync: bool) -> float:
        if sync and self._cuda:
            torch.cuda.synchronize()
        return self._clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def remaining(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def spent(self) -> bool:
        return self.remaining() <= 0

    def step_done(self, step: int, *, measure: bool = False) -> None:
        """Record that ``step`` steps are complete (``measure``: wait for the device first, for
        an exact reading right after)."""
        if self._mark is None and step >= self.skip_steps:
            self._mark = (step, self._now(sync=True))
        else:
            self._last = (step, self._now(sync=measure))

    def seconds_per_step(self) -> float | None:
        """Mean seconds per step after the skipped ones; None until two points are recorded."""
        if self._mark is None or self._last is None or self._last[0] <= self._mark[0]:
            return None
        return (self._last[1] - self._mark[1]) / (self._last[0] - self._mark[0])

    def steps_that_fit(self, done: int, *, reserve: float = 0.0, most: int | None = None) -> int | None:
        """``done`` plus the steps that fit in the time left after keeping the fraction
        ``reserve`` of it (for validation, checkpoints), at most ``most``; None before a
        measurement or without a budget."""
        per_step = self.seconds_per_step()
        if per_step is None or self.seconds is None:
            return None
        fit = done + max(0, int((1.0 - reserve) * self.remaining() / max(per_step, 1e-12)))
        return fit if most is None else min(most, fit)
