"""Training and evaluation of language models: typed functions, no printing.

``train`` runs AdamW (weight-decay groups) with a warmup + cosine schedule, gradient clipping
and accumulation, bf16 autocast on CUDA, periodic validation (loss, bits per byte, perplexity),
atomic resumable checkpoints and a loss-curve PNG. Progress is reported to a callback (the
command line turns it into a progress bar). The same function runs under
``torchrun --nproc_per_node=N``: every rank computes its slice of each global batch, gradients
are averaged by DistributedDataParallel, and rank 0 alone calls the callback and writes files.

Pieces other loops reuse: :func:`train_step` (one optimizer step: forward under autocast, loss,
backward with accumulation, clipping, learning rate, update), :class:`TimeBudget` (how many steps
fit a wall-clock budget), :func:`lr_at` / :func:`continue_schedule` (the schedule).

Output folder layout (``out_dir``): the run folder of ``xlstm_kit.checkpoint`` (``latest``,
``checkpoints/step-N/``) plus ``metrics.jsonl`` (one JSON object per step / validation; after
a failure it keeps the rows up to the newest checkpoint, and a run that saved none leaves none)
and ``loss.png`` (the loss curve, written at the end when matplotlib is installed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Union

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from ._extras import install_hint
from .checkpoint import (CHECKPOINT_FORMAT, CHECKPOINTS_DIR, LATEST_FILE, TRAIN_META_FILE,  # noqa: F401
                         TRAIN_STATE_FILE, CheckpointError, atomic_write, load_optimizer_state,
                         load_training_state, load_weights_into, read_train_meta, remove_stale_staging,
                         resolve_checkpoint, restore_rng, save_checkpoint)
from .data import BatchSampler, TokenData, val_batches
from .packing import IGNORE, PackedSampler, evaluate_packed, model_forward
from .compiling import CompileEvent, CompileClock, compile_failure, compile_unavailable, prepare_model  # noqa: F401
from .errors import XLSTMKitError

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
PRECISIONS = ("auto", "bf16", "fp32")


# --------------------------------------------------------------------------------------------
# Configuration and events
# --------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping settings of one training run (saved in every checkpoint)."""

    steps: int = 1000
    """Total optimizer steps; the cosine schedule ends here."""
    batch_size: int = 16
    """Sequences per optimizer step, summed over ranks and accumulation micro-steps."""
    seq_len: int = 256
    """Tokens per training sequence."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (each rank processes batch_size/(world*grad_accum))."""
    lr: float = 2e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 50
    """Linear warmup length in steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not biases, norms, embeddings)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment coefficients."""
    eps: float = 1e-8
    """AdamW denominator epsilon. Parameters whose gradient is mathematically zero (the sLSTM
    input-gate bias: c/n is invariant to it) receive rounding noise, which Adam scales up to
    updates of up to ~lr·noise/(noise+eps); a larger eps damps that."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    eval_interval: int = 100
    """Validate every this many steps (and at the end; 0: only at the end)."""
    eval_batches: int = 8
    """Validation batches (of batch_size sequences) per validation."""
    eval_at_start: bool = True
    """Also validate before the first step of a fresh run."""
    checkpoint_interval: int = 200
    """Write a checkpoint every this many steps (and at the end and on interrupt; 0: not
    periodically)."""
    keep_checkpoints: int = 2
    """Completed checkpoints kept on disk (the newest ones)."""
    seed: int = 0
    """Seeds the data order (and torch's generator at the start of a fresh run)."""
    precision: str = "auto"
    """"auto" (bf16 autocast on CUDA, float32 on CPU), "bf16" or "fp32"."""
    decay_anchor: tuple[int, float] | None = None
    """(step, progress): from this step on, the cosine decay goes from `progress` (its fraction
    already done) to 1 at `steps`. Set by :func:`continue_schedule` when a resumed run changes
    `steps`, so the learning rate goes on from where it was instead of jumping."""
    compile: bool = False
    """torch.compile the model for training (Inductor). An xLSTM model is compiled per block
    (``XLSTMLanguageModel.compile_blocks``: each block type is compiled once, however deep the
    model, and checkpoints keep the plain model's keys); validation runs it eagerly. Any other
    model is compiled whole (``model.compile()``). The first step pays the compilation; its extra
    time is reported as a :class:`CompileEvent` and a ``compile_s`` row in metrics.jsonl.
    Results equal eager training up to floating-point rounding."""
    activation_checkpointing: str = "none"
    """Recompute blocks' forward in the backward instead of storing their activations: "none",
    "all", or one block type "mlstm" | "slstm" | "dplr" (True / False mean "all" / "none").
    Saves memory at the cost of one more forward of those blocks; gradients are unchanged.
    Needs a model with ``set_activation_checkpointing`` (XLSTMLanguageModel)."""
    pack: bool | None = None
    """Pack documents (``xlstm_kit.packing``): windows over the document stream, the state reset
    at each document start (the model's ``cu_seqlens``), validation equal to evaluating each
    document alone. None: where the data have documents and the model takes cu_seqlens."""

    def __post_init__(self) -> None:
        from .model import checkpoint_blocks

        self.betas = tuple(self.betas)
        if not isinstance(self.compile, bool):
            raise XLSTMKitError(f"TrainConfig.compile must be True or False, got {self.compile!r}")
        if self.pack not in (None, True, False):
            raise XLSTMKitError(f"TrainConfig.pack must be None, True or False, got {self.pack!r}")
        self.activation_checkpointing = checkpoint_blocks(self.activation_checkpointing)
        if self.decay_anchor is not None:
            self.decay_anchor = (int(self.decay_anchor[0]), float(self.decay_anchor[1]))
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "keep_checkpoints"):
            if int(getattr(self, name)) < 1:
                raise XLSTMKitError(f"TrainConfig.{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "eval_batches", "checkpoint_interval"):
            if int(getattr(self, name)) < 0:
                raise XLSTMKitError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise XLSTMKitError(f"need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.weight_decay < 0 or self.grad_clip < 0 or not self.eps > 0:
            raise XLSTMKitError("TrainConfig.weight_decay and grad_clip must be >= 0 and eps > 0")
        if self.precision not in PRECISIONS:
            raise XLSTMKitError(f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.batch_size % self.grad_accum:
            raise XLSTMKitError(
                f"TrainConfig.batch_size ({self.batch_size}) must be divisible by grad_accum ({self.grad_accum})"
            )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["decay_anchor"] = list(self.decay_anchor) if self.decay_anchor is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class EvalMetrics:
    """Validation figures: mean loss in nats per token, bits per UTF-8 byte, perplexity."""

    loss: float
    bits_per_byte: float
    perplexity: float
    tokens: int
    batches: int = 0
    """Validation batches used (all ranks together)."""
    split_batches: int = 0
    """Batches the whole validation split holds (batches == split_batches: all of it)."""

    def describe(self) -> str:
        """"8 of 50 batches, 16,384 tokens" or "all 50 batches, 102,400 tokens"."""
        part = (f"all {self.split_batches}" if self.batches >= self.split_batches
                else f"{self.batches} of {self.split_batches}")
        return f"{part} validation batches, {self.tokens:,} tokens"


@dataclass
class StepEvent:
    step: int  # optimizer steps completed
    total_steps: int
    loss: float  # mean training loss of this step (all ranks)
    lr: float
    grad_norm: float
    tokens_per_s: float  # global tokens of this step / its wall time


@dataclass
class EvalEvent:
    step: int
    metrics: EvalMetrics


@dataclass
class CheckpointEvent:
    step: int
    path: Path


TrainEvent = Union[StepEvent, EvalEvent, CheckpointEvent, CompileEvent]


@dataclass
class TrainResult:
    step: int  # optimizer steps completed
    interrupted: bool
    time_limited: bool = False  # stopped by `time_limit_s` before config.steps
    losses: list[tuple[int, float]] = field(default_factory=list)  # this process's run only
    evals: list[tuple[int, EvalMetrics]] = field(default_factory=list)
    checkpoint: Path | None = None
    plot: Path | None = None
    plot_note: str | None = None  # why there is no plot (matplotlib missing)


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


# --------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Loss and evaluation
# --------------------------------------------------------------------------------------------


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


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None,
    token_bytes: np.ndarray,
    device: torch.device | str = "cpu",
    precision: str = "auto",
    dist: DistInfo | None = None,
    doc_starts: np.ndarray | None = None,
) -> EvalMetrics:
    """Mean next-token loss over fixed validation windows (see ``data.val_batches``); with
    ``doc_starts`` (document starts in ``tokens``) over packed documents, each read as if alone
    (``packing.evaluate_packed``).

    Bits per byte = summed loss (nats) / (ln 2 · UTF-8 bytes of the target tokens), using the
    tokenizer's byte length of each token (``token_bytes`` [vocab]), so byte-level and BPE
    models are comparable. Under DDP the windows are shared out and the sums all-reduced.
    """
    dist = dist or DistInfo()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # loss nats, tokens, bytes, batches
    def plain():
        for x, y in val_batches(tokens, seq_len, batch_size, max_batches, rank=dist.rank, world_size=dist.world_size):
            x, y = x.to(device), y.to(device)
            with autocast(device, precision):
                logits = model(x)
            yield lm_loss(logits, y, reduction="sum"), y

    try:
        losses = plain() if doc_starts is None else evaluate_packed(
            model, tokens, doc_starts, seq_len=seq_len, max_windows=None if max_batches is None else
            max_batches * batch_size, rank=dist.rank, world_size=dist.world_size,
            autocast=lambda: autocast(device, precision))
        for loss, y in losses:
            y = y[y != IGNORE].cpu().numpy()
            sums[0] += loss.double().item()
            sums[1] += y.size
            sums[2] += float(token_bytes[y].sum())
            sums[3] += 1
        if doc_starts is not None:  # windows one by one (their state carried): count batches of them
            sums[3] = math.ceil(sums[3] / batch_size)
    finally:
        model.train(was_training)
    if dist.enabled:
        sums = sums.to(device)
        torch_dist.all_reduce(sums)
        sums = sums.cpu()
    loss_sum, n_tok, n_bytes, n_batches = sums.tolist()
    loss = loss_sum / max(n_tok, 1.0)
    return EvalMetrics(
        loss=loss,
        bits_per_byte=loss_sum / (math.log(2) * max(n_bytes, 1.0)),
        perplexity=math.exp(min(loss, 700.0)),
        tokens=int(n_tok),
        batches=int(n_batches),
        split_batches=val_batch_count(len(tokens), seq_len, batch_size),
    )


def val_batch_count(n_tokens: int, seq_len: int, batch_size: int) -> int:
    """How many batches ``data.val_batches`` makes of a whole split of ``n_tokens`` tokens."""
    seq = min(seq_len, n_tokens - 1)
    return -(-((n_tokens - 1) // seq) // batch_size) if seq >= 1 else 0


# --------------------------------------------------------------------------------------------
# Metrics log and loss curve
# --------------------------------------------------------------------------------------------


def _read_metrics(path: Path, up_to_step: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if up_to_step is None or row.get("step", 0) <= up_to_step:
                rows.append(row)
    return rows


PLOT_MISSING_NOTE = f"loss plot skipped: matplotlib is not installed ({install_hint('matplotlib')})"


def plot_loss_curve(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    """Write the training (raw and smoothed) and validation loss against step as a PNG.

    ImportError when matplotlib is not installed (``train`` then records PLOT_MISSING_NOTE)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        s, l = map(np.asarray, zip(*train))
        ax.plot(s, l, color="tab:blue", alpha=0.25, lw=0.8)
        # Exponential moving average over about 2% of the run, so short and long runs both
        # get a curve that follows the loss without lagging far behind it.
        beta = min(0.98, 1.0 - 1.0 / max(1.0, len(l) / 50))
        smooth, acc = np.empty_like(l), l[0]
        for j, v in enumerate(l):
            acc = beta * acc + (1 - beta) * v if j else v
            smooth[j] = acc
        ax.plot(s, smooth, color="tab:blue", lw=1.5, label="train (smoothed)")
    if val:
        s, l = map(np.asarray, zip(*val))
        ax.plot(s, l, "o-", color="tab:orange", lw=1.5, ms=4, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------
# The training loop
# --------------------------------------------------------------------------------------------



@dataclass
class StepOutput:
    """Tensors on the device, so that a loop that does not read them every step never waits for
    the GPU (float() them to read)."""

    loss: torch.Tensor  # mean loss of the step over its micro-batches (detached)
    grad_norm: torch.Tensor  # global gradient norm before clipping


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
) -> StepOutput:
    """One optimizer step: for each (inputs, target) of ``micro_batches`` (``n_micro`` of them),
    ``loss_fn(model(inputs), target) / n_micro`` under :func:`autocast` and its backward; then
    clipping of the global gradient norm to ``grad_clip`` (0: no clipping), the learning rate
    ``lr`` set on every parameter group, the update, and the gradients cleared.

    ``model`` may be DistributedDataParallel: only the last micro-batch's backward all-reduces
    the accumulated gradients. ``before_update`` runs just before ``optimizer.step()`` (the
    training loop marks there that an interrupt can no longer be saved consistently).
    """
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    n_done = 0
    for micro, (inputs, target) in enumerate(micro_batches):
        last = micro == n_micro - 1
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
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
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


class _StopRequest:
    """SIGINT/SIGTERM set a flag checked at step boundaries, so the run stops between steps
    and saves a consistent checkpoint. A second Ctrl-C raises KeyboardInterrupt at once."""

    def __init__(self, enabled: bool) -> None:
        self.requested = False
        self._enabled = enabled and threading.current_thread() is threading.main_thread()
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_StopRequest":
        if self._enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _default_device(dist: DistInfo) -> torch.device:
    return torch.device(f"cuda:{dist.local_rank}") if torch.cuda.is_available() else torch.device("cpu")


class _Run:
    """The state of one ``train`` call and its bookkeeping (metrics log, validation,
    checkpoints); ``train`` below is the loop."""

    def __init__(self, model, data, config, out_dir, dist, device, meta, callback) -> None:
        self.model, self.data, self.config, self.meta = model, data, config, meta
        self.out_dir, self.dist, self.device = out_dir, dist, device
        self.writes = out_dir is not None and dist.is_main
        self.emit = callback if (callback is not None and dist.is_main) else (lambda event: None)
        self.optimizer = make_optimizer(model, config)
        self.step = 0
        self.saved_step: int | None = None  # step of the run's newest checkpoint on disk
        self.committing = False  # inside optimizer.step: an interrupt there cannot be saved
        self.history: list[dict[str, Any]] = []
        self.metrics_path = out_dir / METRICS_FILE if out_dir is not None else None
        self.token_bytes = data.tokenizer.token_byte_lengths()
        self.packed = config.pack if config.pack is not None else (
            data.train_docs is not None and "cu_seqlens" in inspect.signature(model.forward).parameters)
        if self.packed and data.train_docs is None:
            raise XLSTMKitError(f"pack=True needs data with documents (several files, or an EOS token in "
                                f"the text, loaded with documents=True); {data.source!r} has none")
        self.sampler = (PackedSampler(data.train, data.train_docs, config.seq_len, config.batch_size, seed=config.seed)
                        if self.packed else BatchSampler(data.train, config.seq_len, config.batch_size, seed=config.seed))
        self.result = TrainResult(step=0, interrupted=False)

    def micro_batches(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the next optimizer step, on the device."""
        n = self.config.grad_accum
        for micro in range(n):
            x, y = self.sampler.batch(self.step, rank=self.dist.rank, world_size=self.dist.world_size,
                                      micro=micro, n_micro=n)
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def start_commit(self) -> None:
        self.committing = True

    def restore(self) -> None:
        """Weights, optimizer, RNG and step from the run's latest checkpoint; the schedule goes
        on smoothly when ``config.steps`` changed (:func:`continue_schedule`)."""
        if self.out_dir is None:
            raise XLSTMKitError("resume=True needs out_dir")
        remove_stale_staging(self.out_dir)
        ckpt = resolve_checkpoint(self.out_dir)
        read_train_meta(ckpt)
        state = load_training_state(ckpt)
        try:
            saved = TrainConfig.from_dict(state["train_config"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt / TRAIN_STATE_FILE} holds an invalid train_config: {e}") from None
        for name in ("batch_size", "seq_len", "seed", "pack"):
            if getattr(saved, name) != getattr(self.config, name):
                raise CheckpointError(
                    f"cannot resume with {name}={getattr(self.config, name)}: the checkpoint was trained "
                    f"with {name}={getattr(saved, name)}"
                )
        load_optimizer_state(self.optimizer, state["optimizer"], ckpt / TRAIN_STATE_FILE)
        load_weights_into(self.model, ckpt)
        restore_rng(state, self.device, ckpt / TRAIN_STATE_FILE)
        self.step = self.saved_step = int(state["step"])
        self.config = continue_schedule(saved, self.config, self.step)

    def open_log(self, resume: bool) -> None:
        if not self.writes:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(self.out_dir)
        if resume:  # drop rows of steps after the checkpoint (a run killed between checkpoints)
            self.history = _read_metrics(self.metrics_path, self.step)
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.history))

    def log(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if self.writes:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def abandon_log(self) -> None:
        """After a failure: metrics.jsonl keeps the rows up to the newest checkpoint, the point a
        resume continues from; a run that saved none (nothing to resume) leaves no log."""
        if not self.writes or not self.metrics_path.exists():
            return
        if self.saved_step is None:
            self.metrics_path.unlink(missing_ok=True)
        else:
            rows = [r for r in self.history if r.get("step", 0) <= self.saved_step]
            atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    def validate(self) -> None:
        c = self.config
        m = evaluate(self.model, self.data.val, seq_len=c.seq_len, batch_size=c.batch_size,
                     max_batches=c.eval_batches or None, token_bytes=self.token_bytes, device=self.device,
                     precision=c.precision, dist=self.dist, doc_starts=self.data.val_docs if self.packed else None)
        self.result.evals.append((self.step, m))
        self.log({"step": self.step, "val_loss": m.loss, "val_bpb": m.bits_per_byte, "val_ppl": m.perplexity,
                  "val_batches": m.batches, "val_tokens": m.tokens})
        self.emit(EvalEvent(self.step, m))

    def save(self, barrier: bool = True) -> None:
        if self.writes:
            self.result.checkpoint = save_checkpoint(self.out_dir, self.model, self.optimizer, self.step,
                                                     self.config, self.meta, keep=self.config.keep_checkpoints)
            self.saved_step = self.step
            self.emit(CheckpointEvent(self.step, self.result.checkpoint))
        if barrier and self.dist.enabled:
            torch_dist.barrier()

    def agree(self, loss: torch.Tensor, stop: bool, late: bool) -> tuple[float, bool, bool]:
        """One small all-reduce carries the loss for logging and any rank's stop request or
        spent time budget, so that every rank stops after the same step."""
        flags = torch.stack([loss.float(), torch.tensor(float(stop), device=loss.device),
                             torch.tensor(float(late), device=loss.device)])
        if self.dist.enabled:
            torch_dist.all_reduce(flags)
            flags[0] /= self.dist.world_size
        return float(flags[0]), bool(flags[1] > 0), bool(flags[2] > 0)

    def finish(self) -> TrainResult:
        self.result.step = self.step
        if self.writes:
            try:
                self.result.plot = plot_loss_curve(self.history, self.out_dir / PLOT_FILE)
            except ImportError:
                self.result.plot_note = PLOT_MISSING_NOTE
        return self.result


def train(
    model: nn.Module,
    data: TokenData,
    config: TrainConfig,
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    callback: Callable[[TrainEvent], None] | None = None,
    device: torch.device | str | None = None,
    dist: DistInfo | None = None,
    meta: dict[str, Any] | None = None,
    handle_signals: bool = True,
    time_limit_s: float | None = None,
) -> TrainResult:
    """Train ``model`` (tokens [B, T] -> logits [B, T, V]) on ``data``.

    out_dir: where checkpoints, metrics and the loss curve go (None: write nothing).
    resume: continue from ``out_dir``'s latest checkpoint: weights, optimizer, step (hence data
      position and learning rate) and RNG are restored, so the run continues exactly as if it
      had not stopped. ``config.steps`` may differ from the checkpoint's: the cosine decay then
      continues from the current learning rate to the new end (:func:`continue_schedule`).
    callback: receives StepEvent / EvalEvent / CheckpointEvent on rank 0 only.
    dist: from :func:`init_distributed`; with world_size > 1 the model is wrapped in
      DistributedDataParallel and each rank trains on its slice of every global batch.
    meta: JSON-serialisable facts stored with each checkpoint (tokenizer, data spec, preset);
      meta["tokenizer"] also goes into the checkpoint's tokenizer.json.
    handle_signals: stop cleanly on SIGINT/SIGTERM, saving a resumable checkpoint.
    time_limit_s: wall-clock budget of this call; when spent, the run validates, saves a
      checkpoint and returns early with ``time_limited`` set (the schedule is not shortened).

    Returns a :class:`TrainResult`; ``interrupted`` is True when a signal or KeyboardInterrupt
    stopped the run (after saving a checkpoint of the last completed step when ``out_dir``).
    """
    dist = dist or DistInfo()
    device = torch.device(device) if device is not None else _default_device(dist)
    out_dir = Path(out_dir) if out_dir is not None else None
    per_rank = config.batch_size // (dist.world_size * config.grad_accum)
    if per_rank * dist.world_size * config.grad_accum != config.batch_size:
        raise XLSTMKitError(
            f"batch_size {config.batch_size} is not divisible by world_size*grad_accum = "
            f"{dist.world_size * config.grad_accum}"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and vocab < data.vocab_size:
        raise XLSTMKitError(f"model vocab_size {vocab} is smaller than the tokenizer's {data.vocab_size}")

    meta = {"tokenizer": getattr(data.tokenizer, "name", None), **(meta or {})}  # generate(text) after load
    model.to(device)
    model.train()
    prepare_model(model, config, device)
    run = _Run(model, data, config, out_dir, dist, device, meta, callback)
    if resume:
        run.restore()
    else:
        torch.manual_seed(config.seed)
    config = run.config
    run.open_log(resume)
    run.result.step = run.step

    forward_model = model
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        forward_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    budget = TimeBudget(time_limit_s)
    compile_clock = CompileClock(config.compile)
    compile_errors = (torch._dynamo.exc.TorchDynamoException,) if config.compile else ()
    tokens_per_step = config.batch_size * config.seq_len
    with _StopRequest(handle_signals) as stop:
        try:
            if run.step == 0 and config.eval_at_start:
                run.validate()
            while run.step < config.steps:
                t0 = time.perf_counter()
                lr = lr_at(run.step, config)
                try:
                    out = train_step(forward_model, run.optimizer, run.micro_batches(), lm_loss, lr=lr,
                                     n_micro=config.grad_accum, precision=config.precision,
                                     grad_clip=config.grad_clip, before_update=run.start_commit)
                except compile_errors as e:
                    raise compile_failure(e) from e
                run.step += 1
                run.committing = False
                step_loss, stop_now, out_of_time = run.agree(out.loss, stop.requested, budget.spent())
                dt = time.perf_counter() - t0
                run.result.losses.append((run.step, step_loss))
                run.log({"step": run.step, "loss": step_loss, "lr": lr})
                run.emit(StepEvent(run.step, config.steps, step_loss, lr, float(out.grad_norm),
                                  tokens_per_step / max(dt, 1e-9)))
                compiled = compile_clock.event(run.step, dt, last=run.step == config.steps)
                if compiled is not None:
                    run.log({"step": compiled.step, "compile_s": compiled.compile_s,
                             "first_step_s": compiled.first_step_s, "step_s": compiled.step_s})
                    run.emit(compiled)
                at_end = run.step == config.steps
                if (config.eval_interval and run.step % config.eval_interval == 0) or at_end \
                        or (out_of_time and not stop_now):
                    run.validate()
                if stop_now:
                    run.result.interrupted = True
                    run.save()
                    break
                if (config.checkpoint_interval and run.step % config.checkpoint_interval == 0) or at_end or out_of_time:
                    run.save()
                if out_of_time and not at_end:
                    run.result.time_limited = True
                    break
        except KeyboardInterrupt:
            # A KeyboardInterrupt outside optimizer.step leaves weights and optimizer state at
            # the last completed step (partial gradients are discarded): save that and stop.
            # One during optimizer.step cannot be saved consistently; the last checkpoint stays.
            run.result.interrupted = True
            run.optimizer.zero_grad(set_to_none=True)
            if not run.committing:
                run.save(barrier=False)
        except BaseException:
            run.abandon_log()
            raise
    return run.finish()
