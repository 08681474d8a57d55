"""TrainConfig: every choice of a training run (saved with each checkpoint, compared on resume)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import XLSTMKitError
from ..models.config import checkpoint_blocks
from ..models.lora import check_rank_alpha

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
PRECISIONS = ("auto", "bf16", "fp32")
PARALLEL = ("ddp", "fsdp")
RESUME_FROZEN = ("batch_size", "seq_len", "seed", "grad_accum", "pack", "lora", "lora_alpha", "lora_targets",
                 "parallel")
"""The settings a resumed run keeps from its checkpoint, in the library and on the command line
alike: they decide which tokens each step reads (batch shape, sampling order, document packing),
how a step's gradient is summed and which parameters it trains (the LoRA adapters' shape), so
changing one would make the resumed run another run; and the checkpoint's layout (one file, or
shards of an FSDP run) is the parallelism's."""


# AdamW's step is about lr in size: far above this every run diverges at once
MAX_LR = 100.0
ON_NONFINITE = ("stop", "skip")
# on_nonfinite="skip": a run whose steps stay non-finite this long has diverged, not hit a bad batch
MAX_SKIPPED_IN_A_ROW = 10


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
    log_interval: int = 1
    """Log the training loss (metrics.jsonl, StepEvent) every this many steps, and at the first
    and the last. Reading it waits for the device: a larger interval keeps small models' steps
    from waiting on the host."""
    eval_interval: int = 100
    """Validate every this many steps (and at the end; 0: only at the end)."""
    eval_batches: int = 8
    """Validation batches (of batch_size sequences) per validation."""
    eval_at_start: bool = True
    """Also validate before the first step of a fresh run."""
    checkpoint_interval: int = 200
    """Write a checkpoint every this many steps (and at the end and on interrupt; 0: not
    periodically)."""
    checkpoint_every_s: float = 0.0
    """Also write a checkpoint once this many seconds have passed since the last one (0: not by
    time), so that a run killed without warning loses at most that much training."""
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
    """Pack documents (``xlstm_kit.training.packing``): windows over the document stream, the state reset
    at each document start (the model's ``cu_seqlens``), validation equal to evaluating each
    document alone. None: where the data have documents and the model takes cu_seqlens."""
    parallel: str = "ddp"
    """How several processes (``torchrun``) share the work: "ddp" (every rank holds the whole
    model, optimizer state included; gradients are all-reduced) or "fsdp" (FSDP2: the weights,
    gradients and optimizer state of each block are sharded over the ranks and gathered for its
    forward and backward; checkpoints are written by every rank through
    torch.distributed.checkpoint). "fsdp" needs a process group, also for one process. A
    single process ignores "ddp"."""
    lora: int = 0
    """LoRA rank: > 0 trains adapters of this rank on the blocks' linear maps (``xlstm_kit.lora``,
    through PEFT) with every other weight frozen; 0 trains the model's own parameters. A model
    that already carries the same adapters (a resumed run) keeps them."""
    lora_alpha: float | None = None
    """LoRA scaling numerator: the adapters add (lora_alpha / lora) B A. None: 2 * lora."""
    lora_targets: tuple[str, ...] | None = None
    """Names of the blocks' linear maps that get adapters (e.g. ("q", "v")). None: every linear
    map but the one-per-head gates (``xlstm_kit.lora.DEFAULT_TARGETS``)."""
    on_nonfinite: str = "stop"
    """What a step whose loss or gradient norm is NaN or infinite does: "stop" the run
    (TrainingDiverged, before that step's update) or "skip" its update (weights and optimizer
    state stay those of the step before, the data and the schedule move on; metrics.jsonl counts
    the skipped steps) and stop only after MAX_SKIPPED_IN_A_ROW skipped steps in a row."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if not isinstance(self.compile, bool):
            raise XLSTMKitError(f"TrainConfig.compile must be True or False, got {self.compile!r}")
        if self.pack not in (None, True, False):
            raise XLSTMKitError(f"TrainConfig.pack must be None, True or False, got {self.pack!r}")
        self.activation_checkpointing = checkpoint_blocks(self.activation_checkpointing)
        if isinstance(self.lora, bool) or not isinstance(self.lora, int) or self.lora < 0:
            raise XLSTMKitError(f"TrainConfig.lora (the LoRA rank) must be an integer >= 0 (0: no LoRA), "
                                f"got {self.lora!r}")
        if self.lora_targets is not None:
            targets = [self.lora_targets] if isinstance(self.lora_targets, str) else self.lora_targets
            if not isinstance(targets, (list, tuple)) or not targets \
                    or not all(isinstance(t, str) and t for t in targets):
                raise XLSTMKitError(f"TrainConfig.lora_targets must be names of linear maps, got {self.lora_targets!r}")
            self.lora_targets = tuple(targets)
        if self.lora:
            check_rank_alpha(self.lora, self.lora_alpha)
        elif self.lora_alpha is not None or self.lora_targets is not None:
            raise XLSTMKitError("TrainConfig.lora_alpha and lora_targets need a LoRA rank (TrainConfig.lora > 0)")
        if self.decay_anchor is not None:
            self.decay_anchor = (int(self.decay_anchor[0]), float(self.decay_anchor[1]))
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_interval", "keep_checkpoints"):
            if int(getattr(self, name)) < 1:
                raise XLSTMKitError(f"TrainConfig.{name} must be a positive integer, got {getattr(self, name)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise XLSTMKitError(f"TrainConfig.seed must be an integer in [0, 2**64) (torch's generators take "
                                f"64 bits), got {self.seed!r}")
        for name in ("warmup_steps", "eval_interval", "eval_batches", "checkpoint_interval"):
            if int(getattr(self, name)) < 0:
                raise XLSTMKitError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "eps", "checkpoint_every_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise XLSTMKitError(f"TrainConfig.{name} must be a finite number, got {v!r}")
        if not 0 < self.lr <= MAX_LR:
            raise XLSTMKitError(f"TrainConfig.lr must be in (0, {MAX_LR:g}] (an AdamW step is about lr in size), "
                                f"got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise XLSTMKitError(f"TrainConfig.min_lr must be in [0, lr] = [0, {self.lr}], got {self.min_lr}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.checkpoint_every_s < 0 or not self.eps > 0:
            raise XLSTMKitError("TrainConfig.weight_decay, grad_clip and checkpoint_every_s must be >= 0 and eps > 0")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise XLSTMKitError(f"TrainConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise XLSTMKitError(f"TrainConfig.on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}")
        if self.parallel not in PARALLEL:
            raise XLSTMKitError(f"TrainConfig.parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if self.precision not in PRECISIONS:
            raise XLSTMKitError(f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.batch_size % self.grad_accum:
            raise XLSTMKitError(
                f"TrainConfig.batch_size ({self.batch_size}) must be divisible by TrainConfig.grad_accum "
                f"({self.grad_accum})"
            )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["decay_anchor"] = list(self.decay_anchor) if self.decay_anchor is not None else None
        d["lora_targets"] = list(self.lora_targets) if self.lora_targets is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise XLSTMKitError(f"TrainConfig has no field {', '.join(unknown)}")
        return cls(**d)
