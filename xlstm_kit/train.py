"""Training and evaluation of language models: typed functions, no printing.

``train`` runs AdamW (weight-decay groups) with a warmup + cosine schedule, gradient clipping
and accumulation, bf16 autocast on CUDA, periodic validation (loss, bits per byte, perplexity),
atomic resumable checkpoints and a loss-curve PNG. Progress is reported to a callback (the
command line turns it into a progress bar). The same function runs under
``torchrun --nproc_per_node=N``: every rank computes its slice of each global batch, gradients
are averaged by DistributedDataParallel, and rank 0 alone calls the callback and writes files.

Output folder layout (``out_dir``)::

    latest                      one line: the relative path of the newest complete checkpoint
    checkpoints/step-00000030/  config.json + model.safetensors (the model checkpoint format)
                                + train_state.pt (optimizer, step, RNG) + train_meta.json
    metrics.jsonl               one JSON object per step / validation
    loss.png                    the loss curve, written at the end

A checkpoint is written into a hidden staging folder, flushed to disk, renamed into place, and
only then does ``latest`` (replaced atomically) point at it: a crash or kill at any moment leaves
``latest`` naming a complete checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import tempfile
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

from .data import BatchSampler, TokenData, _atomic_write, val_batches

CHECKPOINT_FORMAT = 1
LATEST_FILE = "latest"
CHECKPOINTS_DIR = "checkpoints"
TRAIN_STATE_FILE = "train_state.pt"
TRAIN_META_FILE = "train_meta.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
PRECISIONS = ("auto", "bf16", "fp32")


class CheckpointError(ValueError):
    """A missing, incomplete or incompatible training checkpoint."""


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

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "keep_checkpoints"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "eval_batches", "checkpoint_interval"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.weight_decay < 0 or self.grad_clip < 0 or not self.eps > 0:
            raise ValueError("TrainConfig.weight_decay and grad_clip must be >= 0 and eps > 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"TrainConfig.batch_size ({self.batch_size}) must be divisible by grad_accum ({self.grad_accum})"
            )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
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


TrainEvent = Union[StepEvent, EvalEvent, CheckpointEvent]


@dataclass
class TrainResult:
    step: int  # optimizer steps completed
    interrupted: bool
    time_limited: bool = False  # stopped by `time_limit_s` before config.steps
    losses: list[tuple[int, float]] = field(default_factory=list)  # this process's run only
    evals: list[tuple[int, EvalMetrics]] = field(default_factory=list)
    checkpoint: Path | None = None
    plot: Path | None = None


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


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup from lr/warmup to lr
    over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``.

    A pure function of the step, so the schedule's state in a checkpoint is the step count.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------------------
# Loss and evaluation
# --------------------------------------------------------------------------------------------


def _autocast(device: torch.device, precision: str):
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of logits [B, T, V] against targets [B, T], computed in float32."""
    if logits.ndim != 3 or logits.shape[:2] != targets.shape:
        raise ValueError(
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
) -> EvalMetrics:
    """Mean next-token loss over fixed validation windows (see ``data.val_batches``).

    Bits per byte = summed loss (nats) / (ln 2 · UTF-8 bytes of the target tokens), using the
    tokenizer's byte length of each token (``token_bytes`` [vocab]), so byte-level and BPE
    models are comparable. Under DDP the windows are shared out and the sums all-reduced.
    """
    dist = dist or DistInfo()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss nats, tokens, bytes
    try:
        for x, y in val_batches(
            tokens, seq_len, batch_size, max_batches, rank=dist.rank, world_size=dist.world_size
        ):
            x, y = x.to(device), y.to(device)
            with _autocast(device, precision):
                logits = model(x)
            sums[0] += lm_loss(logits, y, reduction="sum").double().item()
            sums[1] += y.numel()
            sums[2] += float(token_bytes[y.cpu().numpy()].sum())
    finally:
        model.train(was_training)
    if dist.enabled:
        sums = sums.to(device)
        torch_dist.all_reduce(sums)
        sums = sums.cpu()
    loss_sum, n_tok, n_bytes = sums.tolist()
    loss = loss_sum / max(n_tok, 1.0)
    return EvalMetrics(
        loss=loss,
        bits_per_byte=loss_sum / (math.log(2) * max(n_bytes, 1.0)),
        perplexity=math.exp(min(loss, 700.0)),
        tokens=int(n_tok),
    )


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _save_model(model: nn.Module, path: Path) -> None:
    if hasattr(model, "save"):
        model.save(path)
    else:  # any other language model: weights only
        from safetensors.torch import save_model

        path.mkdir(parents=True, exist_ok=True)
        save_model(model, str(path / "model.safetensors"))


def _load_model_weights(model: nn.Module, path: Path) -> None:
    """Load a checkpoint's weights into ``model``, refusing one of another configuration."""
    load = getattr(type(model), "load", None)
    if load is None:
        from safetensors.torch import load_model

        load_model(model, str(path / "model.safetensors"))
        return
    loaded = load(path)
    if getattr(loaded, "config", None) != getattr(model, "config", None):
        raise CheckpointError(
            f"checkpoint {path} holds a model of another configuration than the one being trained"
        )
    model.load_state_dict(loaded.state_dict())


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder a path names: a checkpoint itself (has ``config.json`` or
    ``model.safetensors``) or a training output folder (through its ``latest`` file)."""
    path = Path(path)
    if (path / "config.json").is_file() or (path / "model.safetensors").is_file():
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        target = path / latest.read_text().strip()
        if not target.is_dir():
            raise CheckpointError(f"{latest} points to a missing checkpoint {target}")
        return target
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    raise CheckpointError(f"{str(path)!r} holds no checkpoint (no config.json and no '{LATEST_FILE}' file)")


def read_train_meta(checkpoint: Path) -> dict[str, Any]:
    """The ``train_meta.json`` of a checkpoint ({} for a bare model checkpoint); refuses a
    checkpoint written by an incompatible version of the training code."""
    f = Path(checkpoint) / TRAIN_META_FILE
    if not f.is_file():
        return {}
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from None
    fmt = meta.get("format")
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {checkpoint} has training-state format {fmt!r} (written by xlstm_kit "
            f"{meta.get('xlstm_kit_version', '?')}); this version reads format {CHECKPOINT_FORMAT}"
        )
    return meta


def save_checkpoint(
    out_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    config: TrainConfig,
    meta: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write a complete resumable checkpoint of ``step`` atomically and point ``latest`` at it.

    Returns the checkpoint folder. ``meta`` (JSON-serialisable; e.g. tokenizer and data spec)
    is stored in ``train_meta.json``. Older checkpoints beyond ``keep`` are removed afterwards.
    """
    from . import __version__

    out_dir = Path(out_dir)
    root = out_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final, k = root / name, 1
    while final.exists():  # re-saving a step (resume then interrupt): never touch the old one
        final, k = root / f"{name}-{k}", k + 1
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        staging.rmdir()  # model.save creates its folder itself
        _save_model(model, staging)
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "optimizer": optimizer.state_dict(),
            "train_config": config.to_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
        }
        torch.save(state, staging / TRAIN_STATE_FILE)
        info = {
            "format": CHECKPOINT_FORMAT,
            "xlstm_kit_version": __version__,
            "step": step,
            "train_config": config.to_dict(),
            **(meta or {}),
        }
        (staging / TRAIN_META_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _fsync_tree(staging)
        os.rename(staging, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _atomic_write(out_dir / LATEST_FILE, lambda f: f.write(f"{CHECKPOINTS_DIR}/{final.name}\n".encode()))
    _fsync_dir(out_dir)
    _prune_checkpoints(root, keep, final)
    return final


def _checkpoint_step(p: Path) -> tuple[int, int]:
    parts = p.name.split("-")  # step-00000030 or step-00000030-1
    return int(parts[1]), int(parts[2]) if len(parts) > 2 else 0


def _prune_checkpoints(root: Path, keep: int, latest: Path) -> None:
    done = sorted((p for p in root.glob("step-*") if p.is_dir()), key=_checkpoint_step)
    for p in done[:-keep]:
        if p != latest:
            shutil.rmtree(p, ignore_errors=True)


def _remove_stale_staging(out_dir: Path) -> None:
    # Left behind only by a process killed mid-save; never named by `latest`.
    for p in (out_dir / CHECKPOINTS_DIR).glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def load_training_state(checkpoint: Path) -> dict[str, Any]:
    """The ``train_state.pt`` of a checkpoint (tensors and plain containers only)."""
    f = Path(checkpoint) / TRAIN_STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"{checkpoint} has no {TRAIN_STATE_FILE}: it is a model checkpoint, not resumable")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or foreign file
        raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{f} has an unsupported format; this version reads format {CHECKPOINT_FORMAT}")
    return state


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


def plot_loss_curve(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    """Write the training (raw and smoothed) and validation loss against step as a PNG."""
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
      had not stopped. ``config.steps`` may differ from the checkpoint's (extends the run).
    callback: receives StepEvent / EvalEvent / CheckpointEvent on rank 0 only.
    dist: from :func:`init_distributed`; with world_size > 1 the model is wrapped in
      DistributedDataParallel and each rank trains on its slice of every global batch.
    meta: JSON-serialisable facts stored with each checkpoint (tokenizer, data spec, preset).
    handle_signals: stop cleanly on SIGINT/SIGTERM, saving a resumable checkpoint.
    time_limit_s: wall-clock budget of this call; when spent, the run validates, saves a
      checkpoint and returns early with ``time_limited`` set (the schedule is not shortened).

    Returns a :class:`TrainResult`; ``interrupted`` is True when a signal or KeyboardInterrupt
    stopped the run (after saving a checkpoint of the last completed step when ``out_dir``).
    """
    dist = dist or DistInfo()
    device = torch.device(device) if device is not None else _default_device(dist)
    out_dir = Path(out_dir) if out_dir is not None else None
    writes = out_dir is not None and dist.is_main
    per_rank = config.batch_size // (dist.world_size * config.grad_accum)
    if per_rank * dist.world_size * config.grad_accum != config.batch_size:
        raise ValueError(
            f"batch_size {config.batch_size} is not divisible by world_size*grad_accum = "
            f"{dist.world_size * config.grad_accum}"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and vocab < data.vocab_size:
        raise ValueError(f"model vocab_size {vocab} is smaller than the tokenizer's {data.vocab_size}")

    model.to(device)
    model.train()
    optimizer = make_optimizer(model, config)
    step = 0
    if resume:
        if out_dir is None:
            raise ValueError("resume=True needs out_dir")
        ckpt = resolve_checkpoint(out_dir)
        read_train_meta(ckpt)
        state = load_training_state(ckpt)
        saved = TrainConfig.from_dict(state["train_config"])
        for name in ("batch_size", "seq_len", "seed"):
            if getattr(saved, name) != getattr(config, name):
                raise CheckpointError(
                    f"cannot resume with {name}={getattr(config, name)}: the checkpoint was trained "
                    f"with {name}={getattr(saved, name)}"
                )
        _load_model_weights(model, ckpt)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        step = int(state["step"])
    else:
        torch.manual_seed(config.seed)
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(out_dir)
    metrics_path = out_dir / METRICS_FILE if out_dir is not None else None
    history = _read_metrics(metrics_path, step) if (writes and resume) else []
    if writes:
        _atomic_write(metrics_path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in history).encode()))

    ddp_model = model
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = BatchSampler(data.train, config.seq_len, config.batch_size, seed=config.seed)
    token_bytes = data.tokenizer.token_byte_lengths()
    result = TrainResult(step=step, interrupted=False)
    emit = callback if (callback is not None and dist.is_main) else (lambda event: None)

    def log(row: dict[str, Any]) -> None:
        history.append(row)
        if writes:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def run_eval() -> None:
        m = evaluate(
            model, data.val, seq_len=config.seq_len, batch_size=config.batch_size,
            max_batches=config.eval_batches or None, token_bytes=token_bytes, device=device,
            precision=config.precision, dist=dist,
        )
        result.evals.append((step, m))
        log({"step": step, "val_loss": m.loss, "val_bpb": m.bits_per_byte, "val_ppl": m.perplexity})
        emit(EvalEvent(step, m))

    def checkpoint() -> None:
        if writes:
            result.checkpoint = save_checkpoint(
                out_dir, model, optimizer, step, config, meta, keep=config.keep_checkpoints
            )
            emit(CheckpointEvent(step, result.checkpoint))
        if dist.enabled:
            torch_dist.barrier()

    tokens_per_step = config.batch_size * config.seq_len
    deadline = time.monotonic() + time_limit_s if time_limit_s is not None else None
    committing = False
    with _StopRequest(handle_signals) as stop:
        try:
            if step == 0 and config.eval_at_start:
                run_eval()
            while step < config.steps:
                t0 = time.perf_counter()
                lr = lr_at(step, config)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device)
                for micro in range(config.grad_accum):
                    x, y = sampler.batch(
                        step, rank=dist.rank, world_size=dist.world_size, micro=micro, n_micro=config.grad_accum
                    )
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    # Only the last micro-step's backward all-reduces the accumulated gradients.
                    sync = micro == config.grad_accum - 1 or not dist.enabled
                    with (contextlib.nullcontext() if sync else ddp_model.no_sync()):
                        with _autocast(device, config.precision):
                            logits = ddp_model(x)
                        loss = lm_loss(logits, y) / config.grad_accum
                        loss.backward()
                    loss_sum += loss.detach()
                if config.grad_clip > 0:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))
                else:
                    grad_norm = float(
                        torch.linalg.vector_norm(
                            torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
                        )
                    )
                committing = True
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                committing = False
                # One small all-reduce carries the loss for logging and any rank's stop request
                # or spent time budget, so that every rank stops after the same step.
                late = deadline is not None and time.monotonic() >= deadline
                flags = torch.stack([loss_sum.float(), torch.tensor(float(stop.requested), device=device),
                                     torch.tensor(float(late), device=device)])
                if dist.enabled:
                    torch_dist.all_reduce(flags)
                    flags[0] /= dist.world_size
                step_loss, stop_now, out_of_time = float(flags[0]), bool(flags[1] > 0), bool(flags[2] > 0)
                dt = time.perf_counter() - t0
                result.losses.append((step, step_loss))
                log({"step": step, "loss": step_loss, "lr": lr})
                emit(StepEvent(step, config.steps, step_loss, lr, grad_norm, tokens_per_step / max(dt, 1e-9)))
                if (config.eval_interval and step % config.eval_interval == 0) or step == config.steps:
                    run_eval()
                elif out_of_time and not stop_now:
                    run_eval()
                if stop_now:
                    result.interrupted = True
                    checkpoint()
                    break
                if (
                    (config.checkpoint_interval and step % config.checkpoint_interval == 0)
                    or step == config.steps
                    or out_of_time
                ):
                    checkpoint()
                if out_of_time and step < config.steps:
                    result.time_limited = True
                    break
        except KeyboardInterrupt:
            # A KeyboardInterrupt outside optimizer.step leaves weights and optimizer state at
            # the last completed step (partial gradients are discarded): save that and stop.
            # One during optimizer.step cannot be saved consistently; the last checkpoint stays.
            result.interrupted = True
            optimizer.zero_grad(set_to_none=True)
            if not committing and writes:
                result.checkpoint = save_checkpoint(
                    out_dir, model, optimizer, step, config, meta, keep=config.keep_checkpoints
                )
                emit(CheckpointEvent(step, result.checkpoint))
    result.step = step
    if writes and importlib.util.find_spec("matplotlib") is not None:  # the [plot] extra; else plot stays None
        result.plot = plot_loss_curve(history, out_dir / PLOT_FILE)
    return result
