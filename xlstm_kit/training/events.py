"""What `train` reports as it goes (StepEvent, EvalEvent, CheckpointEvent, CompileEvent) and returns
(TrainResult), and the validation metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from .compiling import CompileEvent


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
    skipped_steps: int = 0  # updates skipped for a non-finite loss (TrainConfig.on_nonfinite="skip"), this call
