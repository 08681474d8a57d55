"""RunConfig: the settings of one synthetic-task run (model size, optimisation, budget, device)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import XLSTMKitError
from .models import SLSTM_PRESETS
from .mqar import SPACINGS, VOCAB_SIZE, check_mqar_shape
from .registry import task_set


@dataclass
class RunConfig:
    """Settings of one synthetic-task run (saved in its results file)."""

    steps: int = 20000
    """Most optimizer steps; a time limit may shorten the run (the schedule then fits the steps run)."""
    time_limit_s: float | None = None
    """Wall-clock budget for training plus evaluation (None: run all `steps`)."""
    batch_size: int = 128
    lr: float = 3e-3
    """Peak learning rate. Formal tasks: 3e-3 (H200 probe, width 128: xLSTM[0:1] learned parity by
    step 2000 at 3e-3, by step 3500 at 1e-3). MQAR runs of the CLI default to MQAR_LR instead."""
    min_lr: float = 3e-4
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (the paper's synthetic runs: (0.9, 0.99))."""
    grad_clip: float = 1.0
    d_model: int = 128
    n_heads: int = 4
    n_blocks: int = 2
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    """"fp32" or "bf16" (autocast; see xlstm_kit.training.autocast)."""
    backend: str | None = None
    """xLSTM ops backend: None (the fastest for the device), "torch" or "triton"."""
    slstm: str = "lm"
    """sLSTM block settings (SLSTM_PRESETS): "lm" or "paper" (no conv, standard init, 1 head)."""
    tasks: str = "small"
    """Formal task set (formal.TASK_VARIANTS): "small" vocabularies or the "paper"'s."""
    teacher_forcing: bool = True
    """Formal tasks: False is the paper's format (outputs at PAD positions after the action marker)."""
    train_lengths: tuple[int, int] = (3, 40)
    """Formal tasks: inclusive range of training input lengths."""
    test_lengths: tuple[int, ...] = tuple(range(41, 257))
    """Formal tasks: input lengths evaluated (the scaled accuracy averages over them)."""
    eval_samples: int = 8
    """Formal tasks: test sequences per test length. MQAR: test sequences = 64 x this."""
    eval_batch_size: int = 256
    mqar_seq_len: int = 256
    mqar_pairs: int = 64
    mqar_vocab: int = VOCAB_SIZE
    mqar_spacing: str = "uniform"
    """MQAR query placement (mqar.SPACINGS): "uniform" or Zoology's "powerlaw"."""
    mqar_train_mix: bool = True
    """MQAR training batches: True draws the pairs from 4, 8, ... up to mqar_pairs; False trains
    at mqar_pairs only (the paper's per-setting runs)."""
    log_every: int = 25
    """Record the training loss every this many steps."""
    converged_loss: float | None = None
    """Stop training once CONVERGED_LOGS logged losses in a row are below this (None: train all
    `steps`). For tasks whose test sequences come from the training distribution (MQAR, with
    fresh batches every step), a training loss this low means the test accuracy is reached; the
    formal tasks are scored on longer inputs than they train on, so they keep training."""
    compile: bool | str = False
    """Train through a compiled step: torch.compile of the forward and the loss (the backward
    through AOTAutograd), Inductor with CUDA graphs on CUDA (xlstm_kit.training.compiling.CompiledLoss);
    the optimizer stays eager. True, False, or "auto": compile on CUDA only (the paper
    protocol's setting; on a CPU, Inductor's C++ builds cost minutes per model). Evaluation
    runs eagerly either way."""

    def __post_init__(self) -> None:
        self.train_lengths = tuple(int(v) for v in self.train_lengths)
        self.test_lengths = tuple(int(v) for v in self.test_lengths)
        self.betas = tuple(float(b) for b in self.betas)
        for name in ("steps", "batch_size", "d_model", "n_heads", "n_blocks", "eval_samples",
                     "eval_batch_size", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise XLSTMKitError(f"RunConfig.{name} must be a positive integer, got {v!r}")
        if self.converged_loss is not None and not self.converged_loss > 0:
            raise XLSTMKitError(f"RunConfig.converged_loss must be positive or None, got {self.converged_loss}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise XLSTMKitError(f"RunConfig.time_limit_s must be positive or None, got {self.time_limit_s}")
        if not (0 < self.lr and 0 <= self.min_lr <= self.lr):
            raise XLSTMKitError(f"need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.backend not in (None, "torch", "triton"):
            raise XLSTMKitError(f"RunConfig.backend must be None, 'torch' or 'triton', got {self.backend!r}")
        task_set(self.tasks)  # checks the name
        if self.slstm not in SLSTM_PRESETS:
            raise XLSTMKitError(f"RunConfig.slstm must be one of {', '.join(SLSTM_PRESETS)}, got {self.slstm!r}")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise XLSTMKitError(f"RunConfig.compile must be True, False or 'auto', got {self.compile!r}")
        if self.precision not in ("fp32", "bf16"):
            raise XLSTMKitError(f"RunConfig.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        lo, hi = self.train_lengths if len(self.train_lengths) == 2 else (0, -1)
        if not 2 <= lo <= hi:
            raise XLSTMKitError(f"RunConfig.train_lengths must be (lo, hi) with 2 <= lo <= hi, got {self.train_lengths}")
        if not self.test_lengths or min(self.test_lengths) < 2:
            raise XLSTMKitError(f"RunConfig.test_lengths must be lengths >= 2, got {self.test_lengths}")
        check_mqar_shape(self.mqar_seq_len, self.mqar_pairs, self.mqar_vocab)
        if self.mqar_spacing not in SPACINGS:
            raise XLSTMKitError(f"RunConfig.mqar_spacing must be one of {', '.join(SPACINGS)}, got {self.mqar_spacing!r}")

    @property
    def compiles(self) -> bool:
        """Whether the training step runs compiled on this config's device."""
        return self.compile is True or (self.compile == "auto" and torch.device(self.device).type == "cuda")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train_lengths"], d["test_lengths"] = list(self.train_lengths), list(self.test_lengths)
        d["betas"] = list(self.betas)
        return d


def quick_config(**overrides) -> RunConfig:
    """A CPU smoke-test configuration: tiny widths, few steps, few short test lengths."""
    base = dict(steps=30, batch_size=8, lr=3e-3, min_lr=3e-4, warmup_steps=3, d_model=32, n_heads=4,
                train_lengths=(3, 8), test_lengths=(9, 12), eval_samples=2, eval_batch_size=8,
                mqar_seq_len=64, mqar_pairs=4, mqar_vocab=256, log_every=1)
    return RunConfig(**{**base, **overrides})
